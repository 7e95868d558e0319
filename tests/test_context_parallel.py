"""Chapter 6: ring, Ulysses and all-gather attention equal one process's attention; bytes, work, traps."""
import functools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest

from labs.context_parallel import crossover, methods as cp, traps, ulysses
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
    extra = crossover.sweep_cases(4, seq_len=T, head_dim=D, batch=B) if world_size == 4 else {}
    return {**cp.cases(world_size, T, D, B), **extra}


@functools.lru_cache(maxsize=None)
def run(world_size):
    """One job per world size answers every test below."""
    return launch.spawn(cp.check_many, world_size, cases(world_size), timeout=300)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_method_equals_one_process_attention(world_size):
    for rank_result in run(world_size):
        for name, r in rank_result.items():
            assert max(r["errors"].values()) < TOL, (name, r["errors"])


def derivation(kw, n):
    """Bytes one rank sends, derived here from the shapes (not through the lab's own formula)."""
    kv = B * kw["kv_heads"] * (T // n) * D * 4                       # this rank's K block, fp32
    q = B * kw["heads"] * (T // n) * D * 4
    sent_kv = kv * max(n // kw["kv_heads"], 1)                       # Ulysses: KV heads copied up to cp
    return {"ring": {"forward": 2 * (n - 1) * kv, "backward": 4 * (n - 1) * kv + 2 * kv},
            "allgather": {"forward": 2 * (n - 1) * kv, "backward": 2 * (n - 1) * kv},
            "ulysses": {"forward": (n - 1) * (2 * q + 2 * sent_kv) // n,
                        "backward": (n - 1) * (2 * q + 2 * sent_kv) // n}}[kw["method"]]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_counted_bytes_equal_the_derivation(world_size):
    n = world_size
    for name, kw in cases(world_size).items():
        for r in run(world_size):
            res = r[name]
            assert res["shapes"]["kv"] == [B, kw["kv_heads"], T // n, D]   # sizes read from the tensors used
            if kw.get("hand", True):
                assert res["bytes_sent"] == derivation(kw, n), name     # counted messages
            else:                                                     # all_to_all_single: library calls
                assert res["bytes_sent"] == {"forward": 0, "backward": 0}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ulysses_runs_two_all_to_alls_each_way(world_size):
    """Jacobs et al. §3.2: one all-to-all for Q, K and V together and one for the output."""
    n, h, k = world_size, cases(world_size)["ulysses_library"]["heads"], cases(world_size)["ulysses_library"]["kv_heads"]
    q, kv = B * h * (T // n) * D * 4, B * k * (T // n) * D * 4
    for r in run(world_size):
        lib = r["ulysses_library"]
        assert lib["calls"]["forward"] == {"all_to_all": 2} and lib["calls"]["backward"] == {"all_to_all": 2}
        # the fused message carries Q, K and V of this rank's tokens, then the output: what was handed over
        assert lib["payloads"]["forward"]["all_to_all"]["payloads"] == [q + 2 * kv, q]
        # by hand: one message to each other rank per all-to-all; DeepSpeed's three Q, K, V all-to-alls
        # send the same bytes in twice the messages
        assert r["ulysses_zigzag_gqa"]["messages"] == {"forward": 2 * (n - 1), "backward": 2 * (n - 1)}
        assert r["ulysses_unfused"]["messages"] == {"forward": 4 * (n - 1), "backward": 4 * (n - 1)}
        assert r["ulysses_unfused"]["bytes_sent"] == r["ulysses_zigzag_gqa"]["bytes_sent"]


def test_gqa_bytes_at_equal_kv_head_ratios():
    results = run(4)
    for r in results:
        sent = {name: sum(r[name]["bytes_sent"].values()) for name in crossover.sweep_cases(4)}
        q = B * 8 * (T // 4) * D * 4
        for k in (1, 2, 4, 8):
            for m in ("ring", "allgather", "ulysses"):   # the derivation in units of q, against the count
                assert Fraction(sent[f"{m}_k{k}"], q) == crossover.bytes_per_rank(m, Fraction(k, 8), 4, 8), (m, k)
            fewest = min(("allgather", "ring", "ulysses"), key=lambda m: sent[f"{m}_k{k}"])
            assert fewest == crossover.winner(Fraction(k, 8), 4, 8)
        # copies: below k = cp Ulysses sends what it sends at k = cp; a lab that expanded K and V to all
        # 8 query heads before the all-to-all would send what it sends at k = 8
        assert sent["ulysses_k1"] == sent["ulysses_k2"] == sent["ulysses_k4"] < sent["ulysses_k8"]
        # the ring and the all-gather move only the k KV heads: 8 times fewer bytes at k = 1 than at 8
        assert sent["ring_k8"] == 8 * sent["ring_k1"] and sent["allgather_k8"] == 8 * sent["allgather_k1"]
    # the winners change between the measured points at the derived crossovers, 9/40 and 3/8 of the heads
    assert crossover.crossover("ring", 4, 8) == Fraction(9, 40) and crossover.crossover("allgather", 4, 8) == Fraction(3, 8)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_work_per_rank_is_what_the_kernel_computes(world_size):
    results = run(world_size)
    for name, kw in cases(world_size).items():
        causal, order = kw.get("causal", True), kw["order"]
        beta = cp.diagonal_block(world_size, T, order, kw.get("block"))
        work = [cp.work_units(r[name], world_size, T) for r in results]
        assert work == cp.work_formula(world_size, order, causal, beta, kw["method"]), name
        for r in results:
            # FlopCounterMode sees every matmul the kernel runs: 2 x 2d FLOPs per score entry computed.
            # A kernel that computed hidden tiles, or whole diagonal tiles while its tally said blocks, differs.
            res = r[name]
            assert res["flops"] == 4 * D * res["work"]["score_entries"], name
        # the masks cover exactly the causal triangle (or the square), every entry once over the ranks
        unmasked = sum(r[name]["work"]["unmasked_entries"] for r in results)
        assert unmasked == B * kw["heads"] * (T * (T + 1) // 2 if causal else T * T), name
    # the contiguous split with whole diagonal tiles: ranks compute i + 1 tiles, max/mean 2cp/(cp + 1)
    assert [r["ring_contiguous"]["work"]["tiles_masked"] for r in results] == [1] * world_size
    assert [r["ring_contiguous"]["work"]["tiles_full"] for r in results] == list(range(world_size))


def test_ulysses_rules_for_the_heads():
    with pytest.raises(ValueError, match="divide the query heads: 8 heads on cp = 3"):
        ulysses.check_heads(8, 8, 3)
    with pytest.raises(ValueError, match="cp and the KV heads to divide one another: 3 KV heads on cp = 2"):
        ulysses.check_heads(6, 3, 2)
    ulysses.check_heads(8, 2, 4)                                      # fewer KV heads than cp: copied
    assert [ulysses.kv_repeats(k, 4) for k in (1, 2, 4, 8)] == [4, 2, 1, 1]
    with pytest.raises(ValueError, match="not divisible by 8"):
        cp.check_config(4, 20, "zigzag", "ring", 4, 4)
    with pytest.raises(ValueError, match="block of 4 tokens must divide the chunks of 6"):
        cp.check_config(4, 24, "contiguous", "ring", 4, 4, block=4)


def test_loss_over_a_sharded_sequence():
    # cp = 4, 24 tokens, 15 unmasked: ranks hold 6, 6, 3 and 0 of them
    results = launch.spawn(traps.loss_trap, 4, 15, timeout=120)
    ref = results[0]["reference_loss"]
    assert [r["per_rank_mean"]["local_count"] for r in results] == [6, 6, 3, 0]
    for r in results:
        right = r["global_count"]
        assert right["grad_error"] < TOL and not right["grad_nan"] and math.isclose(right["loss"], ref, rel_tol=1e-5)
        # the empty rank's 0/0 reaches every rank's gradients through the ring's backward
        assert r["per_rank_mean"]["grad_nan"]
    assert [r["per_rank_mean"]["local_loss_nan"] for r in results] == [False, False, False, True]


def test_per_rank_mean_gives_the_wrong_gradient():
    results = launch.spawn(traps.loss_trap, 2, 18, timeout=120)  # 12 and 6 unmasked tokens: no NaN
    for r in results:
        wrong, right = r["per_rank_mean"], r["global_count"]
        assert not wrong["grad_nan"] and wrong["grad_error"] > 1e-3 and right["grad_error"] < TOL
        assert abs(wrong["loss"] - r["reference_loss"]) > 0.1


def test_a_query_with_no_key_is_zero_not_nan():
    assert math.isnan(traps.empty_row(safe=False)["output"][1][0])
    guarded = traps.empty_row(safe=True)
    assert guarded["output"][1] == [0.0] * 4 and guarded["lse"][1] == -math.inf


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.context_parallel.methods", "--world-size", "4", "--method", "ring",
                          "--seq-len", "32", "--causal", "--order", "contiguous", "--kv-heads", "2", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["max_abs_error"] < TOL and r["max_abs_error_grad"] < TOL
    kv = 2 * 2 * 8 * 8 * 4                                             # B, k, T/cp, d, fp32
    assert r["bytes_sent"] == [{"forward": 6 * kv, "backward": 14 * kv}] * 4
    # whole diagonal tiles: rank i computes i + 1 tiles of (T/cp)^2, in units of half a tile
    assert r["work_per_rank"] == [2, 4, 6, 8] and r["work_max_over_mean"] == 1.6
    bad = subprocess.run([sys.executable, "-m", "labs.context_parallel.methods", "--world-size", "3", "--method", "ulysses"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "divide the query heads" in bad.stderr and "Traceback" not in bad.stderr
