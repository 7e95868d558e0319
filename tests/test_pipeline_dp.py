"""Chapter 5: 1F1B on pp=2 x dp=2 ranks, each stage's gradients all-reduced over its DP group."""
import pytest

from labs.launcher import launch
from labs.formulas import schedules
from labs.pipeline import pipeline_dp

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics

TOL = 1e-6   # as tests/test_pipeline.py: a lost or doubled micro-batch errs by order 1e-2


@pytest.fixture(scope="module")
def runs():
    return launch.spawn(pipeline_dp.run, 4, 2, 4, timeout=120)


def test_allreduce_per_stage_and_gradients(runs):
    for r in runs:
        assert r["max_abs_error_grad"] < TOL
        assert r["allreduce_calls"] == 1
        assert r["allreduce_payload_bytes"] == r["stage_param_bytes"] < r["model_param_bytes"]
        assert r["dp_group"] == [r["stage"], r["stage"] + 2]
    assert sum({r["stage"]: r["stage_param_bytes"] for r in runs}.values()) == runs[0]["model_param_bytes"]


def test_allreduce_position(runs):
    p, m = 2, 4
    formula = pipeline_dp.finish_times(p, m)
    assert formula == [15, 13]
    assert [r["issued_at"] for r in sorted(runs, key=lambda r: r["rank"])[:p]] == formula
    sim = schedules.simulate(schedules.one_f_one_b(p, m), schedules.costs("1f1b"))
    assert [tl[-1][2] for tl in sim] == formula


def test_global_batch():
    g = pipeline_dp.global_batch()
    assert g["per_dp"] == g["table_batch_per_dp"] == 16 and g["m"] == 16
    assert g["global_batch_sequences"] * g["seq"] == g["tokens_per_batch"]
    assert g["bubble_1f1b"] == 15 / 31
    with pytest.raises(ValueError, match="micro-batch"):
        pipeline_dp.global_batch(micro_batch=3)
