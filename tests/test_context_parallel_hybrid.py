"""Chapter 6: hybrid context parallelism (Ulysses in a node, the ring across) equals one process and
sends the derived bytes on each link tier, run through its command line on 2 nodes of 2 ranks.

The notebook (section 8) runs the same at 8 and 1 KV heads with the ring and Ulysses beside it, and
asserts every rank's tiers and ledger; its section 7 asserts the ring's work per step. nbval runs
both natively and under OTHER_CPU, so they are not repeated here."""
import json
import os
import subprocess
import sys

import pytest

from labs.context_parallel import hybrid

# compares floating-point results: `make test` runs it again under another CPU's rounding
pytestmark = pytest.mark.numerics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32: the ring's blockwise softmax over the gathered heads, the same few ulps as plain ring
# attention (tests/test_context_parallel.py). A token piece on the wrong member, a ring table in
# the wrong order or a missing block errs by order 0.1 to 1.
TOL = 1e-5


def test_a_grid_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="Ulysses group of 3 ranks must divide the 4 ranks"):
        hybrid.check_grid(4, 3, 24, "zigzag", 8, 8)
    with pytest.raises(ValueError, match="cuts the sequence into 8 pieces: seq_len = 20"):
        hybrid.check_grid(4, 2, 20, "zigzag", 8, 8)


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.context_parallel.hybrid", "--world-size", "4", "--ulysses", "2",
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert max(r[m]["max_abs_error"] for m in ("hybrid", "ring", "ulysses")) < TOL
    # counted by destination on every rank; a hybrid with the mesh's two dimensions swapped would send
    # the all-to-all's Q and O across nodes and the ring's K and V inside them
    assert r["hybrid"]["tiers"] == [r["tier_formula"]] * 4, r["hybrid"]["tiers"]
    q = 2 * 8 * (24 // 4) * 8 * 4               # a rank's Q block (= its K block, 8 KV heads): B, a, T/cp, d, fp32
    intra = (2 - 1) * (2 * q + 2 * q) // 2      # u = 2: the two all-to-alls keep 1/u, send the rest
    assert r["tier_formula"] == {"forward": {"intra": intra, "inter": 2 * (2 - 1) * q},     # R = 2 nodes
                                 "backward": {"intra": intra, "inter": (4 * 2 - 2) * q}}
    bad = subprocess.run([sys.executable, "-m", "labs.context_parallel.hybrid", "--world-size", "4", "--ulysses", "3"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must divide the 4 ranks" in bad.stderr and "Traceback" not in bad.stderr
