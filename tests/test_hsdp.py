"""Chapter 3: HSDP on a 2x2 mesh beside full sharding over 4 (one spawn for every test): which
collectives ran on which group, their bytes against the formulas, gloo's wire bytes against its
source, the training result against one process, and what FSDP2 keeps per rank."""
import pytest
import torch

from labs.zero import distributed_optimizer as dopt, hsdp
from labs.launcher import launch

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics

WORLD, SHARD, LR = 4, 2, 1e-3


@pytest.fixture(scope="module")
def run():
    return launch.spawn(hsdp.hsdp_vs_full, WORLD, SHARD, timeout=300)


def test_hsdp_crosses_nodes_only_with_the_gradient_all_reduce(run):
    p_pad = run[0]["p_pad"][SHARD]
    want = hsdp.formula_bytes(p_pad, WORLD, SHARD)
    for r in run:
        groups = r["hsdp"]["by_group"]
        # the intra-node group carries the gathers and the reduce-scatter, nothing else ...
        assert set(groups["shard"]) == {"all_gather", "reduce_scatter"}
        assert set(groups["replicate"]) == {"all_reduce"}   # ... and only the all-reduce crosses
        assert sum(e["formula_sent"] for e in groups["shard"].values()) == want["shard"]
        # a full-size gradient all-reduce (HSDP without the reduce-scatter first) would be s times this
        assert groups["replicate"]["all_reduce"]["payload"] == p_pad * hsdp.BF16 // SHARD
        assert groups["replicate"]["all_reduce"]["formula_sent"] == want["replicate"]
        # every weight gathered twice (forward, backward) and reduced once: 3 passes of P_pad in bf16
        assert groups["shard"]["all_gather"]["payload"] * SHARD == 2 * p_pad * hsdp.BF16
    assert [r["ranks"]["shard"] for r in run] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ranks"]["replicate"] for r in run] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_full_sharding_puts_three_passes_on_the_group_that_spans_nodes(run):
    p_pad = run[0]["p_pad"][WORLD]
    for r in run:
        (only,) = r["full"]["by_group"].values()
        assert sum(e["formula_sent"] for e in only.values()) == 3 * (WORLD - 1) * p_pad * hsdp.BF16 // WORLD


def test_gloo_wire_bytes_match_gloos_source_for_every_collective(run):
    # gloo's reduce-scatter is a full all-reduce inside, so its wire bytes are twice the ring
    # formula's; a model that took the formula for the wire would fail here
    for r in run:
        for layout in ("hsdp", "full"):
            for rec in r[layout]["records"]:
                if rec["wire_sent"] is None:
                    pytest.skip("wire bytes cannot be read here (not gloo on Linux)")
                assert rec["wire_sent"] == hsdp.gloo_wire_model(rec), rec


def test_hsdp_and_full_sharding_train_like_one_process(run):
    ref = run[0]["reference"]
    for layout in ("hsdp", "full"):
        losses = [[r[layout]["losses"][s] for r in run] for s in range(len(ref["losses"]))]
        # step 0: the same weights, data and shapes, fp32, one thread (the reference runs on one,
        # as every rank): the same operations in the same order, so exact
        assert losses[0] == ref["losses"][0]
        # the first averaged gradient itself, as for the hand stages: Adam would hide a replica
        # all-reduce that summed instead of averaging (2x), the losses and weights would not show it
        assert hsdp.grad_error(run[0][layout]["grads"], ref["grads"]) < hsdp.GRAD_TOL
        # later steps: fp32 gradients summed in another order (rank pairs, then replicas) differ
        # by rounding, ~1e-7 relative
        torch.testing.assert_close(losses, ref["losses"], rtol=1e-5, atol=0)
        # Adam moves a weight by about lr per step whatever the gradient's size, so rounding in a
        # gradient that nearly cancels can change a step by a fraction of lr (2e-5 seen); a
        # replica that missed the all-reduce steps on its own gradient, about lr off: lr / 10
        for name, want in ref["params"].items():
            torch.testing.assert_close(run[0][layout]["params"][name], want, rtol=0, atol=LR / 10, msg=name)


def test_the_gradient_check_refuses_a_summed_or_skipped_all_reduce(run):
    ref = run[0]["reference"]["grads"]
    got = run[0]["hsdp"]["grads"]
    assert hsdp.grad_error(got, ref) < hsdp.GRAD_TOL
    # a replicate all-reduce that summed the 2 replicas instead of averaging: every gradient 2x
    assert hsdp.grad_error({k: 2 * v for k, v in got.items()}, ref) > 0.5
    # a replica that skipped it: this node's gradient alone, not the mean of the two nodes'
    alone = hsdp.reference(SHARD, steps=1)["grads"]   # ranks 0, 1: node 0's batches only
    assert hsdp.grad_error(alone, ref) > 100 * hsdp.GRAD_TOL


def test_fsdp2_keeps_fp32_shards_of_params_grads_and_adam_state(run):
    for layout, d in (("hsdp", SHARD), ("full", WORLD)):
        # HSDP shards over the node only: the replicas keep the same shards, so 16 P / s, not / N
        states = [r[layout]["state"] for r in run[:d]]   # HSDP: ranks 0 and 1 are one node
        got = dopt.check_fsdp2(states, run[0]["params"])
        assert got["bytes_per_param_per_rank"] == got["formula"] == 16 / d
        assert run[0][layout]["state"]["dtypes"] == {"params": "torch.float32", "grads": "torch.float32",
                                                     "adam_moments": "torch.float32",
                                                     "adam_step": "torch.float32"}


def test_the_replica_node_keeps_what_the_first_node_keeps(run):
    """HSDP's ranks 2 and 3 hold the shards of ranks 0 and 1, piece by piece; a replica that kept
    bf16 weights, or its whole unsharded parameters, is refused."""
    states = [r["hsdp"]["state"] for r in run]
    dopt.check_replicas(states, SHARD)
    bf16 = dict(states[2], params=states[2]["params"] // 2,
                dtypes=dict(states[2]["dtypes"], params="torch.bfloat16"))
    whole = dict(states[3], params=states[3]["params"] * SHARD)
    for bad, at in ((bf16, 2), (whole, 3)):
        with pytest.raises(AssertionError, match=f"rank {at} keeps"):
            dopt.check_replicas(states[:at] + [bad] + states[at + 1:], SHARD)


def test_zero3_bandwidth_formula_matches_the_counted_bytes_per_parameter(run):
    # the formula's 3 (n-1)/n x 2 bytes per parameter per step against what full sharding sent
    p_pad = run[0]["p_pad"][WORLD]
    sent = sum(e["formula_sent"] for e in next(iter(run[0]["full"]["by_group"].values())).values())
    got = hsdp.zero3_bandwidth(p_pad, 6 * p_pad, 1, WORLD)
    assert got["step_bytes"] == sent
    ex = hsdp.worked_example()
    assert ex["bandwidth"] == pytest.approx((ex["n"] - 1) / ex["n"] * ex["mfu"]
                                            * 989e12 / ex["tokens_per_rank"]
                                            * 6 * ex["params"] / ex["flops_per_token"], rel=1e-12)
    with pytest.raises(ValueError, match="positive"):
        hsdp.zero3_bandwidth(p_pad, 6 * p_pad, 0, WORLD)


def test_zero3_inter_node_bytes_are_counted_per_node():
    # ranks node by node: a ring crosses each node boundary once, so one rank's bytes leave a node,
    # over the node's 8 rail NICs; HSDP's advantage per node is 3(N-1)/N over 2(r-1)/r, not 1.5 s
    assert hsdp.ring_crossings_per_node(64, 8) == 1
    assert hsdp.ring_crossings_per_node(8, 8) == 0
    ex = hsdp.worked_example()
    assert ex["node_bytes"] == ex["step_bytes"]
    assert ex["node_nic"] == 8 * ex["nic"]
    # the same W as chapters 2 and 4's ring across 8-GPU nodes (labs.formulas.links, one home)
    from labs.formulas import links
    assert ex["node_nic"] == links.ring_bandwidth(ex["n"] // ex["node"], ex["node"])
    assert ex["bandwidth"] == pytest.approx(ex["node_bytes"] / ex["compute_s"])
    r, n = ex["n"] // ex["node"], ex["n"]
    assert ex["bandwidth"] / ex["hsdp_bandwidth"] == pytest.approx(3 * (n - 1) / n / (2 * (r - 1) / r))
    assert 1.5 < ex["bandwidth"] / ex["hsdp_bandwidth"] < 1.75
