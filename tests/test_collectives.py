"""Chapter 10: every collective built from point-to-point messages equals the library's and moves
exactly the formula's rounds and bytes, all counted; RS then AG equals two all-reduces not built
from them; the two-level all-reduce's bytes per link tier are counted; the crossover's inputs are
the counted rounds and bytes. The exercises' checker: tests/test_exercise_answers_ch1011.py."""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from labs.collectives import alpha_beta, toolkit as col
from labs.launcher import launch

# Only the tests that compare floats another CPU rounds differently are marked `numerics` (`make
# test` runs those under OTHER_CPU); the rest compare counts, or sums of small integers, which
# are exact in any order.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32 sums of at most 8 standard normals in another order than the library's: a few ulps of
# numbers of size ~8 (~1e-6); 1e-5 is far below what a wrong block or a missed addend gives (~1).
TOL = 1e-5
NUMEL = 840  # divisible by 2 to 8: equal blocks on every world size tested


@functools.lru_cache(maxsize=None)
def every(world_size):
    """One spawn per world size runs every algorithm it allows."""
    return col.every(world_size, NUMEL, timeout=180)


@pytest.mark.numerics
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


@pytest.mark.parametrize("world_size", [3])   # notebook 10 asserts the same on 4 ranks
def test_reduce_scatter_then_all_gather_equals_two_other_all_reduces(world_size):
    for r in launch.spawn(col.rank_rs_then_ag, world_size, NUMEL, timeout=120):
        # integer-valued fp32 inputs: every order of additions gives the same bits, so any wrong
        # block, missed addend or misplaced copy shows as inequality
        assert r["equals_library"] and r["equals_chapter2_ring"]
        assert r["rs_rounds"] == r["ag_rounds"] == world_size - 1           # counted exchanges
        # chapter 2's ring is other code: its counted bytes are not the sum of these two tallies
        assert (r["rs_bytes"] + r["ag_bytes"] == r["chapter2_ring_bytes"] == 2 * (world_size - 1) * NUMEL
                * 4 // world_size)


@pytest.fixture(scope="module")
def two_level():
    from labs.collectives import hierarchical
    return hierarchical.compare(world_size=4, gpus_per_node=2, numel=NUMEL, timeout=120)


def test_two_level_all_reduce_counted_per_link_tier(two_level):
    r, f = two_level, two_level["formula"]
    for name in ("hierarchical", "flat_ring"):
        assert r[name]["equals_library"], name           # integer inputs: exact by construction
        assert list(zip(r[name]["intra"], r[name]["inter"])) == [tuple(t) for t in f[name]], name
        assert r[name]["rounds"] == f["rounds"][name], name
    # the busiest network link: the flat ring's node-boundary ranks send 2(p-1)/p n across, the
    # two-level all-reduce has every rank send 2(k-1)/k n/g across (k = 2 nodes of g = 2)
    n = r["nbytes"]
    assert max(r["flat_ring"]["inter"]) == 3 * n // 2 and max(r["hierarchical"]["inter"]) == n // 2
    assert sum(r["hierarchical"]["inter"]) < sum(r["flat_ring"]["inter"])
    from labs.collectives import hierarchical
    with pytest.raises(ValueError, match="do not fill nodes"):
        hierarchical.check(6, 4, 24)
    with pytest.raises(ValueError, match="multiple of 4"):
        hierarchical.check(4, 2, 10)


ALPHA, BETA = 150e-6, 1 / 0.8e9          # a known line: 150 us, 0.8 GB/s


def test_fit_line_recovers_a_known_alpha_and_beta():
    """The fit the notebooks use (`alpha_beta.fit_line`), on times made from a known line."""
    sizes = alpha_beta.FIT_SIZES
    exact = alpha_beta.fit_line(sizes, [ALPHA + n * BETA for n in sizes])
    assert exact["alpha"] == pytest.approx(ALPHA, rel=1e-9) and exact["beta"] == pytest.approx(BETA, rel=1e-9)
    assert max(map(abs, exact["residuals"])) < 1e-9
    # +-5 % noise on the small sizes, the two largest 10 % off in opposite directions: the
    # relative-error fit keeps alpha and beta within 5 %; unweighted, the two largest sizes' errors
    # (hundreds of microseconds) tilt the line and move the intercept by more than 20 % of alpha
    noise = [0.05, -0.05, 0.05, -0.05, 0.05, 0.1, -0.1]
    noisy = [(ALPHA + n * BETA) * (1 + e) for n, e in zip(sizes, noise)]
    fit = alpha_beta.fit_line(sizes, noisy)
    assert fit["alpha"] == pytest.approx(ALPHA, rel=0.05) and fit["beta"] == pytest.approx(BETA, rel=0.05)
    assert fit["residuals"] == pytest.approx([(t - p) / t for t, p in zip(noisy, fit["predicted"])])
    a = torch.tensor([[1.0, float(n)] for n in sizes], dtype=torch.float64)
    b = torch.tensor(noisy, dtype=torch.float64)[:, None]
    unweighted = torch.linalg.lstsq(a, b).solution[0, 0].item()
    assert abs(unweighted - ALPHA) > 0.2 * ALPHA             # what the weights are for
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        alpha_beta.fit_line([4, 4], [1e-4, 1e-4])
    with pytest.raises(ValueError, match="positive"):
        alpha_beta.fit_line([4, 8], [1e-4, 0.0])


def test_median_interval_and_verdict():
    from labs.measure import intervals
    assert intervals.median_ranks(15) == (4, pytest.approx(1 - 2 * 576 / 2 ** 15))   # P(B <= 3) = 576/2^15
    assert intervals.median_ranks(6)[0] == 1
    with pytest.raises(ValueError, match="at least 6"):
        intervals.median_ranks(5)
    ring = [1.0] * 15
    faster = intervals.ratio_interval([0.5 + 0.01 * i for i in range(15)], ring)   # ratios 0.50 .. 0.64
    assert (faster["low"], faster["high"], faster["median"]) == pytest.approx((0.53, 0.61, 0.57))
    assert (faster["lowest"], faster["highest"]) == pytest.approx((0.50, 0.64))
    assert intervals.verdict(faster, "doubling", "ring", ranks=4, machine_cores=4) == "doubling"
    assert intervals.verdict(faster, "doubling", "ring", ranks=4, machine_cores=2) == intervals.UNRESOLVED
    # three ratios above 1 among 15: the 4th largest is below 1, so the interval still excludes 1;
    # four above 1 and it does not
    assert intervals.ratio_interval([0.9] * 12 + [1.5] * 3, ring)["high"] < 1
    straddle = intervals.ratio_interval([0.9] * 11 + [1.5] * 4, ring)
    assert intervals.verdict(straddle, "doubling", "ring", machine_cores=4) == intervals.UNRESOLVED
    slower = intervals.ratio_interval([2.0] * 15, ring)
    assert intervals.verdict(slower, "doubling", "ring", machine_cores=4) == "ring"


@pytest.mark.parametrize("world_size", [2, 3, 4, 6, 8])
def test_crossover_costs_are_the_counted_rounds_and_bytes(world_size):
    """The crossover formula's inputs against what the hand algorithms were counted to do."""
    c = alpha_beta.costs(world_size)
    ring, rd = every(world_size)["all_reduce/ring"], every(world_size)["all_reduce/recursive_doubling"]
    n = ring["nbytes"]
    assert c["ring"] == (ring["steps"], max(ring["bytes_sent"]) / n)
    # doubling's critical path: the busiest rank's buffers, plus the fold its partner sent first
    folded = 0 if world_size & (world_size - 1) == 0 else min(rd["bytes_sent"])
    assert c["recursive_doubling"] == (rd["steps"], (max(rd["bytes_sent"]) + folded) / n)
    with pytest.raises(ValueError, match="at least 2"):
        alpha_beta.costs(1)


def test_measured_crossover_and_sweep_sizes():
    from labs.collectives import crossover as X
    sizes, D, R, U = [1000, 2000, 4000, 8000], "recursive_doubling", "ring", "not resolved on this machine"
    assert X.measured_crossover(sizes, [D, U, U, R]) == ("between", (1000, 8000))
    assert X.measured_crossover(sizes, [D, D, U, U]) == ("above", 2000)
    assert X.measured_crossover(sizes, [U, R, R, R]) == ("below", 2000)
    assert X.measured_crossover(sizes, [U] * 4) == ("unresolved", None)
    assert X.measured_crossover(sizes, [D, R, D, R]) == ("unresolved", None)   # contradicts itself
    assert X.describe("between", (1024, 4096)) == "between 1 KiB and 4 KiB"
    assert all(s % 16 == 0 for s in X.sweep_sizes(1e6, 4)) and len(X.sweep_sizes(1e6, 4)) == len(X.FACTORS)
    with pytest.raises(ValueError, match="even world size"):
        X.sweep(3)
    with pytest.raises(ValueError, match="at least 6"):
        X.sweep(2, repeats=5)


def test_latency_model_and_bootstrap():
    """alpha is the fastest try at the smallest size, neither the median of its tries nor the
    line's intercept; beta is fitted with alpha held there; M*'s bootstrap interval resamples."""
    import random
    sizes = [4, 1024, 65536, 1 << 20]
    slow = [1.0, 1.6, 2.2, 1.3, 2.9]                   # every try slower than the line but the first
    m = alpha_beta.model(sizes, [[(ALPHA + n * BETA) * f for f in slow] for n in sizes])
    assert m["alpha"] == pytest.approx(ALPHA + 4 * BETA, rel=1e-12)   # the minimum; the median is 1.6x
    # alpha holds the 4 bytes' own 4 beta, so the model sits 4 beta off the line: within 1e-4
    assert m["beta"] == pytest.approx(BETA, rel=1e-4) and max(map(abs, m["residuals"])) < 1e-4
    # fastest tries off the line: beta is the one-parameter fit with alpha fixed, its residuals the model's
    bent = [[ALPHA * 1.0], [ALPHA * 0.8 + 1024 * BETA], [ALPHA + 65536 * BETA * 1.2], [(1 << 20) * BETA]]
    m = alpha_beta.model(sizes, bent)
    fastest = [t[0] for t in bent]
    x, y = [n / t for n, t in zip(sizes, fastest)], [(t - ALPHA) / t for t in fastest]
    assert m["alpha"] == ALPHA
    assert m["beta"] == pytest.approx(sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x))
    assert m["residuals"] == pytest.approx([(t - ALPHA - n * m["beta"]) / t for n, t in zip(sizes, fastest)])
    assert m["intercept"] != pytest.approx(ALPHA, rel=0.01)          # the free line's, another number
    # noisy tries: the interval has width and holds the estimate strictly inside
    rng = random.Random(1)
    noisy = [[(ALPHA + n * BETA) * (1 + rng.expovariate(3)) for _ in range(9)] for n in sizes]
    b = alpha_beta.bootstrap_crossover(sizes, noisy, 4, draws=200)
    assert b["low"] < b["estimate"] < b["high"] and b["draws"] == 200
    # the level is what the code claims: the share of the draws' M* within [low, high], not a coverage
    assert 0.95 <= b["share"] <= 0.96
    beta = alpha_beta.model(sizes, noisy)["beta"]
    assert b["estimate"] == pytest.approx(alpha_beta.crossover(min(noisy[0]), beta, 4))


def test_pictures_align_rounds():
    """A binomial broadcast's logged exchanges, numbered per rank, land on their common rounds."""
    from labs.collectives import pictures
    snd = lambda d: {"sends": [(d, 8)], "recvs": []}
    rcv = lambda s: {"sends": [], "recvs": [(s, 8)]}
    tree = [[snd(1), snd(2)], [rcv(0), snd(3)], [rcv(0)], [rcv(1)]]      # 4 ranks, from rank 0
    assert pictures.align(tree) == [[0, 1], [0, 1], [1], [1]]


def test_crossover_sweep_contract():
    """A fast run of the notebook's sweep on 2 ranks (no crossover at N = 2: doubling saves one
    alpha at every size): its pieces fit together; its timings are the notebook's to print."""
    from labs.collectives import crossover as X
    r = X.sweep(2, fit_sizes=[4, 1024, 65536], repeats=6, timeout=120)
    assert r["exact"] and r["predicted"] is None and r["sizes"] == [8, 1024, 65536]   # multiples of 4N
    assert all(len(t) == 6 for a in X.ALGORITHMS for t in r["seconds"][a])
    assert len(r["ratios"]) == 3
    assert all(iv["lowest"] <= iv["low"] <= iv["median"] <= iv["high"] <= iv["highest"] for iv in r["ratios"])
    assert r["alpha"] == r["fit_seconds"][0] == min(r["fit_times"][0])   # the latency: fastest, smallest
    assert r["fit_residuals"] == pytest.approx([(t - r["alpha"] - n * r["beta"]) / t   # the model's
                                                for n, t in zip(r["fit_sizes"], r["fit_seconds"])])
    assert r["model_round_smallest"]["ring"] == pytest.approx(r["alpha"] + 8 / 2 * r["beta"])   # M/N bytes
    assert len(X.table(r).splitlines()) == 4


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_bus_bandwidth_factor_is_the_counted_ring_bytes(op):
    """nccl-tests' busbw / algbw (chapter 2's table) against the bytes the hand ring was counted to send."""
    from labs.data_parallel import bus_bandwidth
    for world_size in (3, 4):
        r = every(world_size)[f"{op}/ring"]
        bw = bus_bandwidth.bandwidths(r["nbytes"], 1.0, world_size, op)
        assert bw["busbw"] / bw["algbw"] == pytest.approx(max(r["bytes_sent"]) / r["nbytes"])


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="multiple of 4"):   # 6 ranks fold onto 4 blocks
        col.check("all_reduce", "rabenseifner", 6, 6)
    with pytest.raises(ValueError, match="multiple of 4"):
        col.check("all_gather", "ring", 4, 10)
    with pytest.raises(ValueError, match="not 'ring'"):
        col.check("broadcast", "ring", 4, 10)
    out = subprocess.run([sys.executable, "-m", "labs.collectives.toolkit", "--world-size", "6",
                          "--algorithm", "rabenseifner", "--numel", "6"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "multiple of 4" in out.stderr


def test_cli_json(capsys):
    # in process (test_bad_input_is_one_sentence runs `python -m`): the --json line, parsed
    col.main(["--world-size", "2", "--op", "all_to_all", "--numel", "8", "--json"])
    r = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert r["bytes_sent"] == [16, 16] and r["steps"] == 1
    assert r["max_abs_error"] == 0.0   # an all-to-all moves elements, no arithmetic: exact


@pytest.mark.parametrize("world_size", [3])   # notebook 10 asserts the same on 4 ranks
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


def test_gloo_cli_json_and_bad_input(capsys):
    from labs.collectives import gloo_collectives as gc
    gc.main(["--world-size", "2", "--numel", "8", "--json"])   # in process: no second interpreter to start
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    if rows["all_to_all"]["wire"][0] is not None:
        assert all(r["wire"] == r["wire_model"] for r in rows.values())
    assert rows["all_to_all"]["counted"] == [16, 16] and rows["all_to_all"]["formula_max"] == 16
    with pytest.raises(ValueError, match="multiple of 3"):   # refused before any rank starts
        gc.main(["--world-size", "3", "--numel", "10"])


def test_faster_than_alpha_names_the_larger_sizes_that_beat_the_smallest():
    """The smallest size's fastest try is alpha itself: never listed, even when tied; a larger size tied
    with alpha is not faster; each strictly faster one is, with its time. Catches <= for <, and the
    smallest size listed against itself."""
    from labs.collectives import alpha_beta
    got = alpha_beta.faster_than_alpha([4, 1024, 16384, 65536], [100e-6, 90e-6, 100e-6, 300e-6], 100e-6)
    assert got == {1024: 90e-6}
    assert alpha_beta.faster_than_alpha([8, 1024], [50e-6, 60e-6], 55e-6) == {}
