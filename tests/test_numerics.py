"""The test run's second pass sees another CPU's rounding on this one.

`make test` runs the float-sensitive lab tests (marked ``numerics``) and every notebook once, under the
Makefile's OTHER_CPU settings: ATen's scalar kernels instead of the vectorised ones, oneMKL's most
portable code path (its matrix products block and sum in another order) and oneDNN held to SSE4.1. That
pass proves something only if those settings really change the rounding, which this test checks on the
same operations the labs use.
"""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")

# fp32 products of the shapes the tiny models use, a row sum and a softmax: one hash per result
PROBE = """
import hashlib, torch
torch.manual_seed(0)
out = []
for m, k, n in [(16, 48, 48), (16, 48, 192), (8, 37, 11), (64, 256, 256)]:
    a, b = torch.randn(m, k), torch.randn(k, n)
    out.append(a @ b)
x = torch.randn(64, 333)
out += [x.sum(1), x.softmax(-1)]
print(" ".join(hashlib.sha256(t.numpy().tobytes()).hexdigest()[:12] for t in out))
"""


def other_cpu():
    """The OTHER_CPU settings, read from the Makefile that applies them."""
    with open(os.path.join(REPO, "Makefile")) as f:
        line = next(x for x in f if x.startswith("OTHER_CPU :="))
    return dict(re.findall(r"(\w+)=(\S+)", line.split(":=", 1)[1]))


def probe(extra):
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_other_cpu_names_the_three_code_paths():
    assert set(other_cpu()) == set(VARS)


def test_other_cpu_changes_the_rounding_of_the_labs_operations():
    if any(os.environ.get(v) for v in VARS):
        pytest.skip("already under forced code paths: the native rounding cannot be seen from here")
    native, forced = probe({}), probe(other_cpu())
    assert native == probe({})   # the same process twice: the same bits (the probe is deterministic)
    changed = [i for i, (a, b) in enumerate(zip(native, forced)) if a != b]
    # the matrix products and the reductions all round differently: a pass under these settings
    # is another machine's arithmetic, not this one's again
    assert len(changed) >= 4, (native, forced)
