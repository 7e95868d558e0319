"""Chapter 6: ring, Ulysses and all-gather attention equal one process's attention; bytes, work, traps."""
import functools
import json
import math
import os
import subprocess
import sys

import pytest

from labs.context_parallel import methods as cp, ulysses
from labs.launcher import launch

# compares floating-point results: `make test` runs it again under another CPU's rounding
pytestmark = pytest.mark.numerics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32: the blockwise softmax adds the same terms as the library kernel in another order and
# rescales by exp(L - L_new): a few ulps of outputs and gradients of order 1 (measured < 2e-6).
# A wrong mask, a missing block or a dK left on the wrong rank errs by order 0.1 to 1.
TOL = 1e-5
B, D, T = 2, 8, 24


def cases(world_size):
    return cp.cases(world_size, T, D, B)


@functools.lru_cache(maxsize=None)
def run(world_size):
    """One job per world size answers every test below."""
    return launch.spawn(cp.check_many, world_size, cases(world_size), timeout=180)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_method_equals_one_process_attention(world_size):
    for rank_result in run(world_size):
        for name, r in rank_result.items():
            assert max(r["errors"].values()) < TOL, (name, r["errors"])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_counted_bytes_equal_the_derivation(world_size):
    n = world_size
    for name, kw in cases(world_size).items():
        kv = B * kw["kv_heads"] * (T // n) * D * 4                   # this rank's K block, fp32
        q = B * kw["heads"] * (T // n) * D * 4
        expected = {"ring": {"forward": 2 * (n - 1) * kv, "backward": 4 * (n - 1) * kv + 2 * kv},
                    "allgather": {"forward": 2 * (n - 1) * kv, "backward": 2 * (n - 1) * kv},
                    "ulysses": {"forward": (n - 1) * (2 * q + 2 * kv) // n,
                                "backward": (n - 1) * (2 * q + 2 * kv) // n}}[kw["method"]]
        for r in run(world_size):
            res = r[name]
            assert res["shapes"]["kv"] == [B, kw["kv_heads"], T // n, D]   # sizes read from the tensors used
            assert res["bytes_formula"] == expected
            if kw.get("hand", True):
                assert res["bytes_sent"] == expected, name            # counted messages == derivation
            else:                                                     # all_to_all_single: 4 calls each way
                payloads = res["payloads"]["forward"]["all_to_all"]["payloads"]
                assert payloads == [q, kv, kv, q] and res["bytes_sent"] == {"forward": 0, "backward": 0}


def test_gqa_shrinks_what_ring_and_allgather_send():
    r = run(4)[0]
    # one KV head instead of 8: K/V traffic 8x smaller; Ulysses still moves Q and O in full
    assert r["ring_contiguous"]["bytes_sent"]["forward"] == 8 * r["ring_zigzag_gqa"]["bytes_sent"]["forward"]
    assert r["allgather_contiguous"]["bytes_sent"]["forward"] == 8 * r["allgather_zigzag_gqa"]["bytes_sent"]["forward"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zigzag_balances_the_causal_work(world_size):
    results = run(world_size)
    for name, order, causal in (("ring_contiguous", "contiguous", True), ("ring_zigzag_gqa", "zigzag", True),
                                ("allgather_contiguous", "contiguous", True),
                                ("allgather_zigzag_gqa", "zigzag", True), ("ring_full", "contiguous", False)):
        work = [cp.work_units(r[name], world_size, T) for r in results]
        assert work == cp.work_formula(world_size, order, causal), name
    contiguous = [cp.work_units(r["ring_contiguous"], world_size, T) for r in results]
    zigzag = [cp.work_units(r["ring_zigzag_gqa"], world_size, T) for r in results]
    assert cp.imbalance(contiguous) == (2 * world_size - 1) / world_size     # 1.75 at cp = 4
    assert cp.imbalance(zigzag) == 1.0
    for r in results:
        # FlopCounterMode: 2 matmuls of 2*d FLOPs per score entry of every tile computed (masked
        # entries of a diagonal tile included): computing the hidden tiles too would show here
        w = r["ring_contiguous"]["work"]
        c = T // world_size
        h = cases(world_size)["ring_contiguous"]["heads"]
        assert r["ring_contiguous"]["flops"] == 4 * D * B * h * c * c * (w["tiles_full"] + w["tiles_diagonal"])
    assert [r["ring_contiguous"]["work"]["tiles_full"] for r in results] == list(range(world_size))
    # Ulysses splits heads, not tokens: every rank sees the whole triangle for h/cp heads, cp units
    for name in ("ulysses_contiguous", "ulysses_zigzag_gqa"):
        assert [cp.work_units(r[name], world_size, T) for r in results] == [world_size] * world_size


def test_ulysses_needs_cp_to_divide_the_heads():
    with pytest.raises(ValueError, match="divide the query heads: 8 heads on cp = 3"):
        ulysses.check_heads(8, 8, 3)
    with pytest.raises(ValueError, match="divide the KV heads: 2 KV heads on cp = 4"):
        ulysses.check_heads(8, 2, 4)
    with pytest.raises(ValueError, match="not divisible by 8"):
        cp.check_config(4, 20, "zigzag", "ring", 4, 4)


def test_loss_over_a_sharded_sequence():
    # cp = 4, 24 tokens, 15 unmasked: ranks hold 6, 6, 3 and 0 of them
    results = launch.spawn(cp.loss_trap, 4, 15, timeout=120)
    ref = results[0]["reference_loss"]
    assert [r["per_rank_mean"]["local_count"] for r in results] == [6, 6, 3, 0]
    for r in results:
        right = r["global_count"]
        assert right["grad_error"] < TOL and not right["grad_nan"] and math.isclose(right["loss"], ref, rel_tol=1e-5)
        # the empty rank's 0/0 reaches every rank's gradients through the ring's backward
        assert r["per_rank_mean"]["grad_nan"]
    assert [r["per_rank_mean"]["local_loss_nan"] for r in results] == [False, False, False, True]


def test_per_rank_mean_gives_the_wrong_gradient():
    results = launch.spawn(cp.loss_trap, 2, 18, timeout=120)     # 12 and 6 unmasked tokens: no NaN
    for r in results:
        wrong, right = r["per_rank_mean"], r["global_count"]
        assert not wrong["grad_nan"] and wrong["grad_error"] > 1e-3 and right["grad_error"] < TOL
        assert abs(wrong["loss"] - r["reference_loss"]) > 0.1


def test_a_query_with_no_key_is_zero_not_nan():
    assert math.isnan(cp.empty_row(safe=False)["output"][1][0])
    guarded = cp.empty_row(safe=True)
    assert guarded["output"][1] == [0.0] * 4 and guarded["lse"][1] == -math.inf


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.context_parallel.methods", "--world-size", "4", "--method", "ring",
                          "--seq-len", "32", "--causal", "--order", "contiguous", "--kv-heads", "2", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["max_abs_error"] < TOL and r["max_abs_error_grad"] < TOL
    kv = 2 * 2 * 8 * 8 * 4                                             # B, k, T/cp, d, fp32
    assert r["bytes_sent"] == [{"forward": 6 * kv, "backward": 14 * kv}] * 4
    assert r["work_per_rank"] == [1, 3, 5, 7] and r["work_max_over_mean"] == 1.75
    bad = subprocess.run([sys.executable, "-m", "labs.context_parallel.methods", "--world-size", "3", "--method", "ulysses"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "divide the query heads" in bad.stderr and "Traceback" not in bad.stderr
