"""Chapter 9: torch.compile's recomputation per activation memory budget (`labs.recompute.compiled`).

One compilation per budget at a second shape (1 block, s = 8, b = 1; the notebook runs 2 blocks,
s = 16, b = 2), shared by every test through a module-scoped fixture."""
import json

import pytest

from labs.recompute import compiled as cc, policies

BUDGETS = (1.0, 0.5, 0.0)


@pytest.fixture(scope="module")
def run():
    reason = cc.unavailable()
    if reason:
        pytest.skip(reason)
    return cc.compare(policies.config(layers=1, seq=8), batch=1, budgets=BUDGETS,
                      hand_policies=("none", "full"))


def test_the_budget_trades_kept_bytes_for_recomputed_flops(run):
    c, eager = run["compiled"], run["eager"]
    kept = [c[b]["kept_bytes"] for b in BUDGETS]
    assert kept[0] > kept[1] > kept[2], kept                    # each lower budget keeps strictly less
    flops = [c[b]["backward_flops"] for b in BUDGETS]
    assert flops[0] <= flops[1] < flops[2], flops               # and recomputes at least as much
    # b = 1 is the runtime-optimised cut: matrix products are banned from recomputation
    assert c[1.0]["backward_flops"] == eager["none"]["backward_flops"]
    # b = 0 keeps the region's inputs and nothing else: here x, the only input that is not a weight
    assert c[0.0]["graph_saved_activation_bytes"] == 0
    assert c[0.0]["kept_bytes"] == c[0.0]["input_bytes"]
    assert c[0.0]["kept_bytes"] < eager["full"]["kept_bytes"]   # fewer than a checkpoint per block


def test_budget_zero_recomputes_exactly_one_forward(run):
    """The extra backward FLOPs at b = 0 are the forward's, counted on the uncompiled stack: a
    partition that skipped a needed product, or recomputed one twice, is off by a product."""
    c, eager = run["compiled"], run["eager"]
    assert (c[0.0]["extra_backward_flops"] == run["eager_forward_flops"]
            == eager["full"]["extra_backward_flops"])


def test_the_autograd_node_keeps_what_the_backward_graph_takes(run):
    """Kept bytes are read from the compiled autograd node; the partitioned backward graph's saved
    inputs must be the same tensors: as many, and the activations' bytes plus x's."""
    for b, r in run["compiled"].items():
        assert r["saved_tensors"] == r["graph_saved_inputs"], b
        assert r["kept_bytes"] == r["graph_saved_activation_bytes"] + r["input_bytes"], b


# Not `numerics`: compiled and eager run the same ATen kernels on the same inputs, so whatever a CPU
# rounds, it rounds both the same way; the check runs once.
def test_compiled_gradients_equal_the_uncompiled_ones_bit_for_bit(run):
    """This backend runs eager's ATen kernels on the same inputs, recomputed ones included, so the
    gradients and the loss must be equal, not close: a recomputation in another dtype, or from a
    wrong saved tensor, breaks the equality."""
    for b, r in run["compiled"].items():
        # exact: the same ATen kernels on the same inputs in the same order as eager
        assert r["grads_equal_eager"] and r["max_rel_grad_diff_vs_eager"] == 0, b  # exact: same kernels
        assert r["loss_diff_vs_eager"] == 0, b  # exact: the same forward ops in the same order
    # Inductor's fused kernels would round differently: its bound still catches the wrong tensor
    assert cc.wrong_input_grad_diff(policies.config(layers=2, seq=8), 1) > 4 * cc.grad_bound(2)


def test_bad_input_is_one_sentence_before_anything_compiles(capsys):
    with pytest.raises(ValueError, match="must lie in \\[0, 1\\]"):
        cc.check_budgets((1.0, 1.5))
    with pytest.raises(ValueError, match="highest to lowest"):
        cc.check_budgets((0.0, 1.0))
    with pytest.raises(ValueError, match="measured in one process"):
        cc.main(["--world-size", "2"])
    with pytest.raises(ValueError, match="at least 2 layers"):
        cc.wrong_input_grad_diff(policies.config(layers=1, seq=8), 1)


def test_cli_prints_the_contract_keys(capsys, run):
    cc.main(["--budgets", "0", "--layers", "1", "--seq", "8", "--batch", "1", "--json"])   # in process
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["compiled"]["0.0"]["kept_bytes"] == run["compiled"][0.0]["kept_bytes"]


def test_under_a_dispatch_mode_the_compiled_graph_does_not_run(run):
    """Why kept bytes are read from the autograd node and not from a live-storage dispatch mode:
    under an active TorchDispatchMode (here FlopCounterMode) torch.compile runs the function
    eagerly, so the mode would measure eager autograd."""
    import torch
    import torch._dynamo
    from labs.measure import flops
    record = {"forward_runs": 0}
    torch._dynamo.reset()
    f = torch.compile(lambda x: x.sin().square().sum(), backend=cc._backend(record))
    x = torch.randn(8, requires_grad=True)
    assert type(f(x).grad_fn).__name__ == "CompiledFunctionBackward" and record["forward_runs"] == 1
    with flops.counting():
        loss = f(x)
    assert record["forward_runs"] == 1 and type(loss.grad_fn).__name__ != "CompiledFunctionBackward"
