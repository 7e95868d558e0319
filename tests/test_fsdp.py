"""Chapter 3: the sharded optimizer (ZeRO-1/2), the hand FSDP and FSDP2 train a model none of them
was written for (a frozen layer, an embedding tied to the head, a branch without gradients on odd
steps) with fp32 master + bf16 compute, to the single-process result."""
import pytest
import torch

from labs.zero import fsdp, unseen_model as toy, adam_drift
from labs.launcher import launch

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics

STEPS, LR = 4, 1e-3


@pytest.fixture(scope="module")
def reference():
    return {n: toy.toy_reference(n, STEPS, LR) for n in (2, 3)}


@pytest.fixture(scope="module")
def runs():
    return {n: launch.spawn(toy.train_toy_all, n, STEPS, timeout=300) for n in (2, 3)}


def test_two_ranks_reproduce_one_process_bit_for_bit(reference, runs):
    # One process accumulating the two ranks' micro-batches does the same arithmetic: the same bf16
    # forward and backward per micro-batch (one intra-op thread, as each rank), a 2-term bf16 sum
    # (order-free, so the reduce-scatter's order cannot matter), / 2, fp32 Adam elementwise. So
    # no tolerance: a gradient given to the branch on the odd steps (Adam would move it on its
    # momentum), a frozen weight updated or a tied gradient counted once would all show.
    ref = reference[2]
    for scheme in toy.SCHEMES:
        results = [r[scheme] for r in runs[2]]
        assert [[r["losses"][s] for r in results] for s in range(STEPS)] == ref["losses"], scheme
        for name, want in ref["params"].items():
            torch.testing.assert_close(results[0]["params"][name], want, rtol=0, atol=0,
                                       msg=f"{scheme} {name}")


def test_three_ranks_stay_within_adams_drift_bound(reference, runs):
    # With three ranks the bf16 sum's order differs from one process's, so gradients differ by
    # bf16 rounding; Adam can turn such a difference into a step of the other sign where a gradient
    # is near 0, so the weights are held to `param_bound`: at most twice the largest total Adam
    # movement over the steps, plus one bf16 spacing.
    ref = reference[3]
    bound = adam_drift.param_bound(torch.cat([p.view(-1) for p in ref["params"].values()]), STEPS, LR)
    for scheme in toy.SCHEMES:
        results = [r[scheme] for r in runs[3]]
        assert [r["losses"][0] for r in results] == ref["losses"][0]   # same weights, same data: exact
        for name, want in ref["params"].items():
            diff = (results[0]["params"][name] - want).abs().max().item()
            assert diff <= bound, (scheme, name, diff, bound)
        torch.testing.assert_close(results[0]["params"]["frozen.weight"], toy.toy_model().frozen.weight,
                                   rtol=0, atol=0)   # frozen means never updated
        # the bound passes a run that never moved (it is twice Adam's largest move); the update does not
        assert toy.update_error(results[0]["params"], ref) < adam_drift.UPDATE_TOL


def test_a_run_that_never_steps_passes_the_drift_bound_but_not_the_update_check(reference):
    ref = reference[3]
    start = {k: v.detach() for k, v in toy.toy_model().named_parameters()}
    bound = adam_drift.param_bound(torch.cat([p.view(-1) for p in ref["params"].values()]), STEPS, LR)
    assert max((start[k] - v).abs().max().item() for k, v in ref["params"].items()) <= bound
    assert toy.update_error(start, ref) == 1 > adam_drift.UPDATE_TOL


def test_hand_fsdp_gathers_one_unit_at_a_time_and_frees_everything(runs):
    for n in (2, 3):
        for r in runs[n]:
            assert r["fsdp"]["unsharded_bytes_after_step"] == 0
            # the root (embedding, tied head, branch) stays gathered around its children; besides
            # it, one unit at a time. Gathering the whole model would hold all 5 units.
            assert r["fsdp"]["max_units_gathered"] == 2


def test_hand_fsdp_and_fsdp2_agree_at_three_ranks(runs):
    # Both are compared with one process above; here with each other: both reduce-scatter every
    # unit's bf16 gradients, but FSDP2 pads each parameter (dim 0) and we pad each unit, so their
    # sums over 3 ranks are ordered differently: the same drift bound applies.
    hand, ref = runs[3][0]["fsdp"], runs[3][0]["fsdp2"]
    bound = adam_drift.param_bound(torch.cat([p.view(-1) for p in ref["params"].values()]), STEPS, LR)
    assert max((hand["params"][k] - v).abs().max().item() for k, v in ref["params"].items()) <= bound
    assert hand["losses"][0] == ref["losses"][0]   # step 0: the same weights, data and shapes: exact


def test_bad_inputs_are_refused():
    net = toy.ToyLM()
    with pytest.raises(ValueError, match="submodule of the model"):
        fsdp.HandFSDP(net, [torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="unknown scheme 'ddp'"):
        toy.train_toy(0, 1, "ddp")
