"""Chapter 2: hand-built all-reduces equal the exact sum and move exactly the formula's bytes."""
import json
import os
import subprocess
import sys

import pytest

from labs import comm, launch, ring_allreduce as ra

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32 sums of N standard normals in another order than the float64 reference: a few ulps of the
# sum's magnitude (~sqrt(N) * 4); 1e-5 is far below any wrong-chunk error (order 1).
TOL = 1e-5


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("numel", [1, 7, 1000, 4099])  # fewer elements than ranks, and uneven chunks
def test_ring_equals_the_exact_sum_and_the_formula(world_size, numel):
    results = launch.spawn(ra.run, world_size, numel, "ring", 1, timeout=90)
    m = numel * 4
    assert max(r["max_abs_error"] for r in results) < TOL
    sent = [r["bytes_sent"] for r in results]
    assert sum(sent) == 2 * (world_size - 1) * m  # every element sent 2(N-1) times in all
    assert sent == [4 * comm.ring_allreduce_elements(numel, world_size, r) for r in range(world_size)]
    # each rank within one element of 2(N-1)/N * M per phase
    assert all(abs(s - 2 * (world_size - 1) / world_size * m) <= 2 * 4 for s in sent)
    assert sum(sent) == sum(r["bytes_received"] for r in results)


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_naive_puts_the_load_on_the_root(world_size):
    numel = 101
    results = launch.spawn(ra.run, world_size, numel, "naive", 1, timeout=90)
    assert max(r["max_abs_error"] for r in results) < TOL
    assert results[0]["bytes_sent"] == results[0]["bytes_received"] == (world_size - 1) * numel * 4
    assert all(r["bytes_sent"] == numel * 4 for r in results[1:])


def test_hand_ring_equals_the_library():
    results = launch.spawn(ra.run, 3, 1000, "library", 1, timeout=90)
    assert max(r["max_abs_error"] for r in results) < TOL


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        ra.allreduce(None, "tree")
    with pytest.raises(launch.RankError, match="numel must be at least 1"):
        launch.spawn(ra.run, 2, 0, timeout=60)


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.ring_allreduce", "--world-size", "3", "--numel", "10",
                          "--algorithm", "ring", "--json"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["bytes_sent"] == [56, 52, 52] and r["max_abs_error"] < TOL and r["seconds"] > 0


def test_eight_ranks_with_uneven_chunks():
    results = launch.spawn(ra.run, 8, 1001, "ring", 1, timeout=180)
    assert max(r["max_abs_error"] for r in results) < TOL
    assert sum(r["bytes_sent"] for r in results) == 2 * 7 * 1001 * 4
