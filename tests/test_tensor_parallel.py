"""Chapter 4: the Megatron split equals the unsharded block, with one all-reduce per direction."""
import json
import os
import subprocess
import sys

import pytest

from labs import launch, tensor_parallel as tp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32: the row-parallel layer sums tp partial products where one process sums one long dot
# product, a different order of the same additions: a few ulps of outputs of order 1. A wrong
# slice or a missing all-reduce errs by order 1.
TOL = 1e-5


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_tp_block_equals_the_unsharded_block(world_size, kind):
    b, s, h = 2, 8, 48
    results = launch.spawn(tp.check_block, world_size, kind, b, s, h, timeout=120)
    for r in results:
        assert r["max_abs_error_output"] < TOL and r["max_abs_error_grad"] < TOL, r["grad_errors"]
        assert (r["allreduce_forward"], r["allreduce_backward"]) == (1, 1)
        assert r["allreduce_bytes"] == b * s * h * 4
        # two all-reduces of M bytes, each sending 2(N-1)/N * M per rank
        assert r["allreduce_bytes_sent"] == 2 * 2 * (world_size - 1) * (b * s * h * 4) // world_size
        assert r["local_params"] < r["full_params"]


def test_a_tp_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="the number of heads = 12 is not divisible by tp = 5"):
        tp.check_degree(tp.config(), 5)
    with pytest.raises(launch.RankError, match="not divisible by tp = 5"):
        launch.spawn(tp.check_block, 5, "mlp", timeout=120)


def test_all_reduce_carries_activations_not_weights():
    shapes = [(1, 8, 48), (2, 8, 48), (2, 16, 48), (2, 16, 96)]
    rows = launch.spawn(tp.message_bytes, 2, shapes, timeout=120)[0]
    assert [r["message_bytes"] for r in rows] == [b * s * h * 4 for b, s, h in shapes]  # linear in h, not h^2


def test_training_under_tp_gives_the_single_process_losses():
    r = launch.spawn(tp.train, 2, timeout=180)[0]
    assert r["losses_tp"] == pytest.approx(r["losses_single"], rel=1e-5)
    assert r["params_held"] < r["params_full"]


def test_dtensor_parallelize_module_matches_the_hand_split():
    results = launch.spawn(tp.dtensor_mlp, 2, timeout=120)
    for r in results:
        assert r["max_abs_error_output"] < TOL and r["max_abs_error_grad"] < TOL
        assert r["placements"]["fc.weight"] == "(Shard(dim=0),)" and r["placements"]["proj.weight"] == "(Shard(dim=1),)"


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.tensor_parallel", "--world-size", "2", "--block", "attention",
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["allreduce_forward"] == r["allreduce_backward"] == 1
    assert r["max_abs_error_output"] < TOL and r["max_abs_error_grad"] < TOL and r["allreduce_bytes"] == 2 * 8 * 48 * 4
    bad = subprocess.run([sys.executable, "-m", "labs.tensor_parallel", "--world-size", "5"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not divisible by tp = 5" in bad.stderr and "Traceback" not in bad.stderr
