"""Chapter 4: the Megatron split equals the unsharded block, with one all-reduce per direction."""
import json
import os
import subprocess
import sys

import pytest

from labs.launcher import launch
from labs.tensor_parallel import blocks as tp, megatron

# The tests marked `numerics` compare floating-point results: `make test` runs them under
# another CPU's rounding. The others compare bytes, counts, schedules or refusals.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32: the row-parallel layer sums tp partial products where one process sums one long dot
# product, a different order of the same additions: a few ulps of outputs of order 1. A wrong
# slice or a missing all-reduce errs by order 1.
TOL = 1e-5


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_tp_blocks_equal_the_unsharded_blocks(world_size):
    b, s, h = 2, 8, 48
    for rank_result in launch.spawn(tp.check_blocks, world_size, ("mlp", "attention"), b, s, h, timeout=120):
        for kind, r in rank_result.items():
            assert r["max_abs_error_output"] < TOL and r["max_abs_error_grad"] < TOL, (kind, r["grad_errors"])
            # read from the tensors g (forward) and f (backward) handed to the collective: b*s*h fp32
            # activations each; all-reducing the MLP's 4h hidden, or a weight, would show here
            assert r["allreduce_ops"] == ["g forward", "f backward"]
            assert r["allreduce_payloads"] == {"forward": [b * s * h * 4], "backward": [b * s * h * 4]}
            assert r["allreduce_bytes"] == b * s * h * 4
            # 1/N of the split weights and biases (fc or qkv, proj's weight) per rank, proj's bias in full
            split = 8 * h * h + 4 * h if kind == "mlp" else 4 * h * h + 3 * h
            assert r["full_params"] - r["local_params"] == split - split // world_size


def test_a_tp_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="the number of heads = 12 is not divisible by tp = 5"):
        megatron.check_degree(tp.config(), 5)
    with pytest.raises(launch.RankError, match="not divisible by tp = 5"):
        launch.spawn(tp.check_block, 5, "mlp", timeout=120)


def test_all_reduce_carries_activations_not_weights():
    from labs.tensor_parallel import forms
    shapes = [(1, 8, 48), (2, 8, 48), (2, 16, 48), (2, 16, 96)]
    job = launch.spawn(forms.forms, 2, shapes, timeout=120)   # the notebook's one start of 2 ranks
    rows = job[0]["payloads"]
    for r in job:
        _check_forms(r["forms"], 2, 8, 48)
    assert [r["calls"] for r in rows] == [1] * len(shapes)
    assert [r["shape"] for r in rows] == [(b, s, h) for b, s, h in shapes]
    assert [r["message_bytes"] for r in rows] == [b * s * h * 4 for b, s, h in shapes]  # linear in h, not h^2


@pytest.mark.numerics
def test_training_under_tp_gives_the_single_process_losses_and_gradients():
    for r in launch.spawn(tp.train, 2, timeout=180):
        assert r["losses_tp"] == pytest.approx(r["losses_single"], rel=1e-5)
        assert r["params_held"] < r["params_full"]
        # every parameter's first gradient, replicated ones included, against one process's (its slice)
        assert max(r["grad_errors"].values()) < TOL, r["grad_errors"]
        assert {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "head.weight",
                "blocks.0.ln1.weight", "blocks.0.mlp.proj.bias"} <= set(r["replicated"])


@pytest.mark.numerics
def test_replicated_gradients_summed_over_tp_are_refused_though_the_losses_agree():
    """The named mistake: the replicated parameters' gradients all-reduced (SUM) over the TP ranks,
    tp times too large. Adam's step hardly sees a gradient's scale, so the losses still agree; the
    gradient check must not."""
    for r in launch.spawn(tp.train, 2, timeout=180):
        summed = r["grad_errors_summed"]
        assert all(summed[n] > 0.5 for n in r["replicated"]), summed        # (tp - 1) = 100 % off
        assert max(summed[n] for n in summed if n not in r["replicated"]) < TOL, summed
        assert r["losses_summed"] == pytest.approx(r["losses_single"], rel=1e-5)  # blind to it


@pytest.mark.numerics
def test_dtensor_parallelize_module_matches_the_hand_split():
    results = launch.spawn(tp.dtensor_mlp, 2, timeout=120)
    for r in results:
        assert r["max_abs_error_output"] < TOL and r["max_abs_error_grad"] < TOL
        assert (r["placements"]["fc.weight"] == "(Shard(dim=0),)"
                and r["placements"]["proj.weight"] == "(Shard(dim=1),)")


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.tensor_parallel.blocks", "--world-size", "2", "--block",
                          "attention", "--json"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["allreduce_forward"] == r["allreduce_backward"] == 1
    assert (r["max_abs_error_output"] < TOL and r["max_abs_error_grad"] < TOL
            and r["allreduce_bytes"] == 2 * 8 * 48 * 4)
    bad = subprocess.run([sys.executable, "-m", "labs.tensor_parallel.blocks", "--world-size", "5"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not divisible by tp = 5" in bad.stderr and "Traceback" not in bad.stderr


def test_layer_costs_at_70b_scale():
    c = tp.layer_costs("70B", tp=8, seq=4096, micro_batch=1)
    assert c["hh_weight_bytes"] == 128 * 2**20      # 8192 x 8192 x 2 bytes: 128 MiB, not 256
    assert c["message_bytes"] == 64 * 2**20           # 4096 x 8192 x 2 bytes
    assert c["sent_bytes"] == 2 * 2 * 7 / 8 * 64 * 2**20
    # Llama 2 70B layer: q, o 8192^2; k, v 8192 x 1024; SwiGLU 3 x 8192 x 28672; two norms of 8192
    layer = 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert c["matmul_flops"] == 2 * layer / 8 * 4096
    assert c["attention_flops"] == 4 * 4096**2 * 8192 / 8
    assert tp.check("1", 64) and not tp.check("1", 256)


def test_exercise_1_names_division_by_tp():
    # 64 MiB / tp = 8 is a factor 8 too; the named mistake wins over the bits-and-bytes slip
    from labs.measure import exercises
    ok, text = exercises.verdict(tp.EXERCISES, "1", 8, mistakes=tp.MISTAKES)
    assert not ok and "divided by tp" in text and "bits" not in text, text



def _check_forms(r, b, s, h):
    """The MLP's two forms (`forms.check`): each equals the unsharded MLP; the partial sums go into
    the all-reduce and into the reduce-scatter, the all-gather takes this rank's b*s/2 tokens; by the
    ring formula a reduce-scatter and an all-gather send what one all-reduce sends."""
    assert max(r["error_allreduce"], r["error_ag_rs"]) < TOL, r
    ar, ag, rs = r["allreduce"]["all_reduce"], r["ag_rs"]["all_gather"], r["ag_rs"]["reduce_scatter"]
    assert ar["payloads"] == rs["payloads"] == [b * s * h * 4] and ag["payloads"] == [b * s * h * 2]
    assert ag["formula_bytes_sent"] + rs["formula_bytes_sent"] == ar["formula_bytes_sent"]


def test_the_collective_matmul_picture_follows_the_ring_formula():
    import matplotlib
    matplotlib.use("Agg")
    from labs.tensor_parallel import forms
    for t, x, mm in ((4, 3.0, 2.0), (3, 1.0, 2.0)):
        fig, end = forms.draw_async(t, x, mm)
        assert end["no overlap"] == (t - 1) * x + t * mm
        assert end["collective matmul"] == (t - 1) * max(x, mm) + mm
