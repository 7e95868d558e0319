"""Chapter 6: hybrid context parallelism (Ulysses in a node, the ring across) refuses a grid it
cannot make, in one sentence, before any rank starts.

The notebook (section 8) runs the hybrid at 8 and 1 KV heads on 2 nodes of 2 ranks with the ring
and Ulysses beside it, against one process, and asserts every rank's bytes per link tier and its
ledger; its section 7 asserts the ring's work per step. nbval runs both natively and under
OTHER_CPU, so they are not repeated here."""
import os
import subprocess
import sys

import pytest

from labs.context_parallel import hybrid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_grid_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="Ulysses group of 3 ranks must divide the 4 ranks"):
        hybrid.check_grid(4, 3, 24, "zigzag", 8, 8)
    with pytest.raises(ValueError, match="cuts the sequence into 8 pieces: seq_len = 20"):
        hybrid.check_grid(4, 2, 20, "zigzag", 8, 8)


def test_command_line_refuses_a_grid_before_any_rank_starts():
    """The full run (`--world-size 4 --ulysses 2 --json`) is the notebook's section 8, which asserts
    every rank's tiers against the derivation: not repeated here, to keep the test time."""
    bad = subprocess.run([sys.executable, "-m", "labs.context_parallel.hybrid", "--world-size", "4",
                          "--ulysses", "3"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must divide the 4 ranks" in bad.stderr and "Traceback" not in bad.stderr
