"""Chapter 6: hybrid context parallelism (Ulysses in a node, the ring across) equals one process and
sends the derived bytes on each link tier; the ring's work per step follows from its tiles."""
import json
import os
import subprocess
import sys

import pytest

from labs.context_parallel import hybrid, ring_steps
from labs.context_parallel.methods import diagonal_block
from labs.launcher import launch

# compares floating-point results: `make test` runs it again under another CPU's rounding
pytestmark = pytest.mark.numerics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32: the ring's blockwise softmax over the gathered heads, the same few ulps as plain ring
# attention (tests/test_context_parallel.py). A token piece on the wrong member, a ring table in
# the wrong order or a missing block errs by order 0.1 to 1.
TOL = 1e-5


@pytest.fixture(scope="module")
def grid():
    """2 nodes x 2 ranks; without GQA and with one KV head (copied to both ranks of a node)."""
    return {kv: launch.spawn(hybrid.check, 4, 2, 24, 8, kv, timeout=300) for kv in (8, 1)}


@pytest.mark.parametrize("kv_heads", [8, 1])
def test_hybrid_equals_one_process_attention(grid, kv_heads):
    for r in grid[kv_heads]:
        for method, res in r.items():
            assert max(res["errors"].values()) < TOL, (method, res["errors"])


@pytest.mark.parametrize("kv_heads", [8, 1])
def test_bytes_per_link_tier_are_the_derivation(grid, kv_heads):
    for rank, r in enumerate(grid[kv_heads]):
        h = r["hybrid"]
        assert h["tiers"] == h["tier_formula"], (rank, h["tiers"])
        for method, res in r.items():               # the ledger by destination saw every counted message
            assert {p: sum(t.values()) for p, t in res["tiers"].items()} == res["bytes_sent"], method
    # `tier_formula` puts the all-to-all inside the node and the ring across: a hybrid with the mesh's
    # two dimensions swapped would send the Q and O bytes across nodes and fail the equality above


def test_a_grid_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="Ulysses group of 3 ranks must divide the 4 ranks"):
        hybrid.check_grid(4, 3, 24, "zigzag", 8, 8)
    with pytest.raises(ValueError, match="cuts the sequence into 8 pieces: seq_len = 20"):
        hybrid.check_grid(4, 2, 20, "zigzag", 8, 8)


def test_ring_work_per_step_follows_from_the_tiles():
    results = launch.spawn(ring_steps.timed, 4, 24, 2, 8, 1, ("contiguous", "zigzag"), 1, timeout=300)
    for order in ("contiguous", "zigzag"):
        measured = [ring_steps.step_units(r[order], 1, 2, 24, 4) for r in results]        # [rank][step]
        want = ring_steps.step_work_formula(4, order, diagonal_block(4, 24, order))        # [step][rank]
        assert [list(x) for x in zip(*measured)] == want, order
        for rank, r in enumerate(results):
            assert [s["owner"] for s in r[order]] == [(rank - s) % 4 for s in range(4)]


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.context_parallel.hybrid", "--world-size", "4", "--ulysses", "2",
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["hybrid"]["max_abs_error"] < TOL and r["hybrid"]["tiers"][0] == r["tier_formula"]
    bad = subprocess.run([sys.executable, "-m", "labs.context_parallel.hybrid", "--world-size", "4", "--ulysses", "3"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must divide the 4 ranks" in bad.stderr and "Traceback" not in bad.stderr
