"""Chapter 1: the calculator reproduces the papers; the lab measures what the calculator says."""
import json
import os
import subprocess
import sys

import pytest

from labs import budget, launch, precision

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("stage,per_param", [(0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)])
def test_zero_stages_shard_the_16_bytes(stage, per_param):
    assert budget.state_bytes_per_param(stage, dp=8)["total"] == pytest.approx(per_param)


def test_zero_paper_table1_is_reproduced():
    table = budget.zero_table1()
    for stage in (0, 1, 2, 3):
        assert budget.matches_paper(table[stage], budget.ZERO_PAPER_TABLE1[stage]), stage


def test_a_wrong_formula_would_not_match_table1():
    twelve = [2 + 2 + 8 / dp for dp in budget.ZERO_PAPER_TABLE1["dp"]]  # the notes' 12-byte ZeRO-1
    assert not budget.matches_paper([x * 7.5 for x in twelve], budget.ZERO_PAPER_TABLE1[1])


def test_llama_parameter_counts_come_out_of_the_shapes():
    # Published sizes: Llama 2 7B = 6.74B, 13B = 13.0B, 70B = 69.0B; Llama 3.1 405B = 405.9B (rounded).
    got = {k: round(a.params() / 1e9, 2) for k, a in budget.MODELS.items()}
    assert got["7B"] == 6.74 and round(got["13B"], 1) == 13.0
    assert round(got["70B"], 1) == 69.0 and round(got["405B"], 1) == 405.9


def test_activation_formula_parallel_variants():
    s, b, h, a = 2048, 1, 12288, 96
    full = budget.activation_bytes_per_layer(s, b, h, a)
    assert full == s * b * h * (34 + 5 * a * s / h)
    assert budget.activation_bytes_per_layer(s, b, h, a, tp=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert budget.activation_bytes_per_layer(s, b, h, a, tp=8, sp=True) == pytest.approx(full / 8)
    assert budget.activation_bytes_per_layer(s, b, h, a, tp=8, sp=True, recompute="selective") == s * b * h * 34 / 8
    assert budget.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    assert budget.activation_bytes_per_layer(s, b, h, a, dropout=False) == s * b * h * (32 + 2 * a * s / h)


@pytest.mark.parametrize("kwargs,message", [
    (dict(model="8B"), "unknown model '8B'"),
    (dict(world_size=12, tp=8), "not divisible by tp\\*pp = 8"),
    (dict(world_size=24, pp=3), "pp must divide the layers"),
    (dict(zero_stage=4), "zero_stage must be"),
    (dict(recompute="some"), "recompute must be"),
    (dict(recipe="int4"), "unknown recipe"),
])
def test_bad_configurations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        budget.budget(**kwargs)


def test_ddp_does_not_fit_7b_in_80gb():
    r = budget.budget("7B", world_size=8, zero_stage=0, seq=1, micro_batch=1)
    assert r["gb_per_device"]["parameters"] + r["gb_per_device"]["optimizer_state"] > 80
    assert not r["fits"]
    assert budget.budget("7B", world_size=8, zero_stage=3, recompute="full")["fits"]


def test_the_lab_measures_what_the_calculator_says_on_three_ranks():
    results = launch.spawn(budget.measure, 3, ("mixed", "fp32", "mixed_fp32_accum"), timeout=120)
    for name in ("mixed", "fp32", "mixed_fp32_accum"):
        measured = [r["recipes"][name]["bytes_per_param"] for r in results]
        assert measured == [precision.recipe(name).bytes_per_param()["total"]] * 3
        # data parallel: after the all-reduce every replica holds the same weights
        assert len({r["recipes"][name]["param_checksum"] for r in results}) == 1
    for row in results[0]["activations"]:
        assert row["measured"] == row["formula"] + row["layernorm_stats"]


def test_calculator_command_line_prints_json():
    out = subprocess.run([sys.executable, "-m", "labs.budget", "--model", "70B", "--world-size", "64",
                          "--tp", "8", "--zero-stage", "1", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert (r["dp"], r["tp"], r["zero_stage"]) == (8, 8, 1)
    assert r["gb_per_device"]["total"] == pytest.approx(sum(v for k, v in r["gb_per_device"].items() if k != "total"))


def test_calculator_command_line_refuses_a_bad_split():
    proc = subprocess.run([sys.executable, "-m", "labs.budget", "--world-size", "12", "--tp", "8"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: world_size 12 is not divisible")
