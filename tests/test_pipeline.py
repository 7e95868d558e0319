"""Chapter 5: every schedule computes one process's gradients, with the formula's bubble."""
import json
import os
import subprocess
import sys

import pytest

from labs import launch, pipeline, schedules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32 gradients of m micro-batches summed one by one vs one backward over the whole batch:
# a few ulps of gradients of order 1e-2; a lost or doubled micro-batch errs by order 1e-2.
TOL = 1e-6


def _cases():
    for p in (2, 3, 4):
        for m in range(1, 3 * p + 1):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            if m >= p:  # ZB-H1's formula counts on enough W passes to fill the p-1 gaps
                yield "zb", p, m, 1
            if m % p == 0:
                yield "interleaved", p, m, 2


@pytest.mark.parametrize("name,p,m,v", list(_cases()))
def test_simulated_bubble_equals_the_formula(name, p, m, v):
    lists = schedules.build(name, p, m, v)
    cost = schedules.costs(name, v)
    measured = schedules.bubble(schedules.simulate(lists, cost, v), cost)
    assert measured["over_ideal"] == pytest.approx(schedules.formula(name, p, m, v)["over_ideal"], abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 1), (3, 2), (3, 7), (4, 8)])
def test_peak_in_flight(p, m):
    assert [schedules.peak_inflight(a) for a in schedules.gpipe(p, m)] == [m] * p
    assert [schedules.peak_inflight(a) for a in schedules.one_f_one_b(p, m)] == [min(p - s, m) for s in range(p)]


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="m=5 is not a multiple of p=2; use m=6"):
        schedules.build("interleaved", 2, 5, 2)
    with pytest.raises(ValueError, match="applies to the interleaved schedule only"):
        schedules.build("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="unknown schedule 'dualpipe'"):
        schedules.build("dualpipe", 2, 4)
    with pytest.raises(ValueError, match="do not split into p\\*v = 5"):
        pipeline.split(pipeline.tiny.build(pipeline.config()), 5)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("name,m,v", [("gpipe", 4, 1), ("gpipe", 2, 1), ("1f1b", 5, 1), ("1f1b", 2, 1),
                                      ("zb", 4, 1), ("interleaved", 6, 2)])
def test_executor_gradients_and_bubble(p, name, m, v):
    results = launch.spawn(pipeline.run, p, name, m, v, 0.0, timeout=180)
    r = pipeline.summarize(results, name, m, v)
    assert r["max_abs_error_grad"] < TOL
    # the logical clocks travel with the real messages, so this is the executed timeline's bubble
    if name != "zb" or m >= p:
        assert r["bubble_fraction"] == pytest.approx(r["bubble_fraction_formula"], abs=1e-12)
    if name == "1f1b":
        assert r["peak_inflight"] == [min(p - s, m) for s in range(p)]
    if name == "gpipe":
        assert r["peak_inflight"] == [m] * p


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 2)])
def test_torch_pipelining_gives_the_same_gradients(name, v):
    results = launch.spawn(pipeline.library, 2, name, 4, v, timeout=180)
    assert max(r["max_abs_error_grad"] for r in results) < TOL


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.pipeline", "--world-size", "2", "--schedule", "1f1b",
                          "--microbatches", "3", "--unit-ms", "5", "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=180, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["max_abs_error_grad"] < TOL and r["peak_inflight"] == [2, 1]
    assert r["bubble_fraction"] == pytest.approx(r["bubble_fraction_formula"]) == pytest.approx(1 / 4)
    assert 0 <= r["bubble_fraction_wallclock"] < 1
    bad = subprocess.run([sys.executable, "-m", "labs.pipeline", "--world-size", "2", "--schedule", "interleaved",
                          "--microbatches", "5", "--chunks", "2"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not a multiple of p=2" in bad.stderr and "Traceback" not in bad.stderr
