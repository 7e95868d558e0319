"""Chapter 3: hand-built ZeRO holds and sends exactly the formulas' bytes and trains like one process."""
import json
import os
import subprocess
import sys

import pytest
import torch

from labs import launch, zero

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each rank's bf16 gradient is rounded before the average, one process rounds the whole batch's:
# they agree to a few bf16 ulps (2^-8 relative) of the largest entry. A missing 1/N is off by 50%+.
GRAD_TOL = 0.02


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_held_and_sent_equal_the_formulas(world_size, stage):
    results = launch.spawn(zero.run, world_size, stage, 2, timeout=180)
    padded = results[0]["padded"]
    assert padded % world_size == 0 and padded - results[0]["numel"] < world_size
    for r in results:
        assert r["held"]["total"] == zero.formula_bytes(stage, padded, world_size)
        assert r["comm_bytes_per_step"] == zero.formula_comm(stage, padded, world_size)
        assert r["grad_rel_error_vs_single_process"] < GRAD_TOL
        assert r["max_param_diff_vs_single_process"] <= r["param_bound"]


def test_every_stage_takes_exactly_the_ddp_step():
    runs = {s: launch.spawn(zero.run, 3, s, 3, timeout=180)[0] for s in zero.STAGES}
    for s in (1, 2, 3):
        assert runs[s]["losses"] == runs[0]["losses"]
        torch.testing.assert_close(runs[s]["params"], runs[0]["params"], rtol=0, atol=0)


def test_zero3_sends_one_and_a_half_times_ddp():
    ddp, z3 = (launch.spawn(zero.run, 4, s, 1, timeout=180)[0]["comm_bytes_per_step"] for s in (0, 3))
    assert z3 / ddp == 1.5


def test_zero1_with_an_all_reduce_moves_three_psi():
    r = launch.spawn(zero.run, 2, 1, 2, zero1_allreduce=True, timeout=180)[0]
    assert r["comm_bytes_per_step"] == zero.formula_comm(1, r["padded"], 2, zero1_allreduce=True)
    assert r["comm_bytes_per_step"] == 3 * (2 - 1) * r["padded"] * 2 // 2


def test_fsdp2_matches_hand_zero3_and_shards_every_weight():
    world_size = 2
    hand = launch.spawn(zero.run, world_size, 3, 3, timeout=180)[0]
    fsdp = launch.spawn(zero.fsdp2, world_size, 3, timeout=180)
    # Same recipe, same sums: bf16 weights cast from the same fp32 masters, bf16 reduce-scatter.
    # Adam's fp32 arithmetic differs by ulps at most, which the bf16 cast absorbs here.
    assert fsdp[0]["losses"] == pytest.approx(hand["losses"], rel=1e-4)
    assert sum(r["local_numel"] for r in fsdp) == fsdp[0]["numel"]
    for shard in fsdp[0]["shards"].values():
        assert shard["placements"] == "(Shard(dim=0),)"
        assert shard["local_shape"][0] == -(-shard["full_shape"][0] // world_size)


def test_bad_stage_is_refused():
    with pytest.raises(ValueError, match="stage must be 0"):
        zero.ZeRO(None, 4)


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.zero", "--world-size", "2", "--stage", "2", "--steps", "2",
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=180, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["state_bytes"] == [r["state_bytes_formula"]] * 2
    assert r["comm_bytes_per_step"] == [r["comm_bytes_formula"]] * 2
    assert {"numel", "max_param_diff_vs_single_process"} <= set(r)
