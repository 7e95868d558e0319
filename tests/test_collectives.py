"""Chapter 10: every collective built from point-to-point messages equals the library's and moves
exactly Thakur-Rabenseifner-Gropp's rounds and bytes; AR = RS then AG; the alpha-beta fit is sane."""
import functools
import json
import os
import subprocess
import sys

import pytest

from labs.collectives import alpha_beta, toolkit as col
from labs.launcher import launch

# compares floating-point results: `make test` runs it again under another CPU's rounding
pytestmark = pytest.mark.numerics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32 sums of at most 8 standard normals in another order than the library's: a few ulps of
# numbers of size ~8 (~1e-6); 1e-5 is far below what a wrong block or a missed addend gives (~1).
TOL = 1e-5
NUMEL = 840  # divisible by 2 to 8: equal blocks on every world size tested


@functools.lru_cache(maxsize=None)
def every(world_size):
    """One spawn per world size runs every algorithm it allows."""
    return col.every(world_size, NUMEL, timeout=180)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7, 8])
def test_every_collective_equals_the_library_and_the_formula(world_size):
    results = every(world_size)
    assert len(results) == 10  # recursive doubling and halving too: folded where p is not 2^k
    for key, r in results.items():
        f = r["formula"]
        assert r["max_abs_error"] < TOL, key
        assert r["steps"] == f["steps"], key
        assert max(r["bytes_sent"]) == f["max_bytes_sent"], key
        assert r["total_bytes_sent"] == f["total_bytes_sent"], key


def test_folding_costs_two_rounds_and_the_folded_data_twice():
    # 6 = 4 + 2: doubling on 4, plus a fold and an unfold of the whole buffer; a formula that forgot
    # the fold (lg 4 = 2 rounds, 2n) or used ceil(lg 6) = 3 swaps of n would disagree with the count
    r, n = every(6)["all_reduce/recursive_doubling"], every(6)["all_reduce/recursive_doubling"]["nbytes"]
    assert (r["steps"], max(r["bytes_sent"]), r["total_bytes_sent"]) == (4, 3 * n, 2 * 2 * n + 4 * 2 * n)
    # ranks 0, 2 fold (send n once); 1, 3 take their data, swap twice, unfold (3n); 4, 5 only swap (2n)
    assert r["bytes_sent"] == [n, 3 * n, n, 3 * n, 2 * n, 2 * n]
    rab = every(7)["all_reduce/rabenseifner"]           # 7 = 4 + 3: the ring's bytes on 4, plus n
    assert max(rab["bytes_sent"]) == 2 * 3 * n // 4 + n and rab["steps"] == 2 * 2 + 2


def test_the_count_can_disagree_with_the_wrong_formula():
    # recursive doubling sends the whole buffer lg p times; counted as a ring it would be wrong
    r = every(4)["all_reduce/recursive_doubling"]
    ring = col.formula("all_reduce", "ring", 4, r["nbytes"])
    assert max(r["bytes_sent"]) == 2 * r["nbytes"] != ring[1]
    # Rabenseifner has the ring's bytes in fewer rounds: 2 lg p = 4 against 2(p-1) = 6
    rab = every(4)["all_reduce/rabenseifner"]
    assert (rab["steps"], max(rab["bytes_sent"])) == (4, ring[1]) and ring[0] == 6


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_all_reduce_is_reduce_scatter_then_all_gather(world_size):
    for r in launch.spawn(col.rank_rs_then_ag, world_size, NUMEL, timeout=120):
        assert r["max_abs_error"] < TOL
        assert r["identical"]  # the same additions in the same order as the ring all-reduce
        assert r["rs_bytes"] + r["ag_bytes"] == r["ar_bytes"] == 2 * (world_size - 1) * NUMEL * 4 // world_size


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="multiple of 4"):   # 6 ranks fold onto 4 blocks
        col.check("all_reduce", "rabenseifner", 6, 6)
    with pytest.raises(ValueError, match="multiple of 4"):
        col.check("all_gather", "ring", 4, 10)
    with pytest.raises(ValueError, match="not 'ring'"):
        col.check("broadcast", "ring", 4, 10)
    out = subprocess.run([sys.executable, "-m", "labs.collectives.toolkit", "--world-size", "6", "--algorithm",
                          "rabenseifner", "--numel", "6"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "multiple of 4" in out.stderr


def test_cli_json():
    out = subprocess.run([sys.executable, "-m", "labs.collectives.toolkit", "--world-size", "2", "--op", "all_to_all",
                          "--numel", "8", "--json"], capture_output=True, text=True, cwd=REPO, check=True)
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["bytes_sent"] == [16, 16] and r["steps"] == 1
    assert r["max_abs_error"] == 0.0   # an all-to-all moves elements, no arithmetic: exact


def test_alpha_beta_fit_and_crossover_are_sane():
    fit = alpha_beta.fit(sizes=[4, 4096, 65536, 262144], repeats=5)
    # least squares: the residuals are orthogonal to both columns of the design (1 and n)
    residuals = [t - p for t, p in zip(fit["seconds"], fit["predicted"])]
    assert abs(sum(residuals)) < 1e-9 * len(residuals) + 1e-6 * max(fit["seconds"])
    assert abs(sum(n * r for n, r in zip(fit["sizes"], residuals))) < 1e-6 * max(fit["seconds"]) * sum(fit["sizes"])
    assert alpha_beta.crossover(1e-5, 1e-9, 2) is None          # p = 2: doubling always wins
    assert alpha_beta.crossover(1e-5, 1e-9, 4) == pytest.approx(4 * 1e-5 / (0.5 * 1e-9))
    # p = 6: 2 doubling rounds among 4 ranks plus fold and unfold, 4 rounds of n, against the ring's 10
    assert alpha_beta.crossover(1e-5, 1e-9, 6) == pytest.approx(6 * 1e-5 / ((4 - 10 / 6) * 1e-9))
    for p in range(2, 9):   # the time model walks the same rounds the lab counts
        assert alpha_beta.doubling_rounds(p) == col.formula("all_reduce", "recursive_doubling", p, 4 * p)[0]
    with pytest.raises(ValueError, match="at least 2"):
        alpha_beta.crossover(1e-5, 1e-9, 1)


def test_bench_rows_use_nccl_tests_factors():
    result = alpha_beta.bench(2, ops=("all_reduce", "all_gather"), sizes=[4096], repeats=2)
    ar, ag = result["rows"]
    assert ar["busbw"] == pytest.approx(ar["algbw"])          # 2(n-1)/n = 1 at n = 2
    assert ag["busbw"] == pytest.approx(ag["algbw"] / 2)      # (n-1)/n


@pytest.mark.parametrize("world_size", [3, 4])
def test_gloo_wire_bytes_equal_the_model_of_its_source(world_size):
    from labs.collectives import gloo_collectives as gc
    rows = gc.beside(world_size, NUMEL, timeout=120)
    for op, r in rows.items():
        if r["wire"][0] is None:
            pytest.skip(r["wire_reason"])
        assert r["wire"] == r["wire_model"], op              # measured == gloo's algorithm, per rank
        assert max(r["counted"]) == r["formula_max"], op      # counted == TRG 2005
    n = rows["reduce"]["nbytes"]
    # gloo's reduce is a ring: the root too sends its (p-1)/p n share of the reduce-scatter, the others
    # that and their chunk of n/p; the hand binomial tree's root sends nothing
    red = rows["reduce"]
    assert red["counted"][0] == 0 < red["wire"][0] < red["wire"][1]
    # the chunk to the root (n/p and two preambles) against the root's p-1 receive notices
    assert red["wire"][1] - red["wire"][0] == n // world_size + 2 * 48 - (world_size - 1) * 48
    # gloo's reduce-scatter is a full all-reduce: twice the ring reduce-scatter's payload, and more
    assert rows["reduce_scatter"]["wire"] == rows["all_reduce"]["wire"]
    assert rows["reduce_scatter"]["wire"][0] > 2 * max(rows["reduce_scatter"]["counted"])


def test_gloo_cli_json_and_bad_input():
    out = subprocess.run([sys.executable, "-m", "labs.collectives.gloo_collectives", "--world-size", "2", "--numel", "8",
                          "--json"], capture_output=True, text=True, cwd=REPO, check=True, timeout=60)
    rows = json.loads(out.stdout.splitlines()[-1])["rows"]
    if rows["all_to_all"]["wire"][0] is not None:
        assert all(r["wire"] == r["wire_model"] for r in rows.values())
    assert rows["all_to_all"]["counted"] == [16, 16] and rows["all_to_all"]["formula_max"] == 16
    from labs.collectives import gloo_collectives as gc
    with pytest.raises(ValueError, match="multiple of 3"):   # refused before any rank starts
        gc.main(["--world-size", "3", "--numel", "10"])
