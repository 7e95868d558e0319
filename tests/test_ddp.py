"""Chapter 2: the hand-built DDP trains exactly like torch's DDP and like one process."""
import functools
import json
import os
import statistics
import subprocess
import sys

import pytest

import workers
from labs.measure import comm, wire
from labs.data_parallel import hand_ddp
from labs.launcher import launch
from labs import model as tiny

# The tests marked `numerics` compare floating-point results: `make test` runs them under
# another CPU's rounding. The others compare bytes, counts, schedules or refusals.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# All three runs sum the same fp32 gradients in different orders (bucket layout, ring chunks, one
# big batch), a few ulps per step; after a few SGD steps of lr 0.1 that stays below 1e-6, while a
# missing average or a skipped bucket moves parameters by 1e-3 or more.
TOL = 1e-6


@functools.lru_cache(maxsize=None)
def suite(world_size):
    """One spawn per world size for all the checks below (a spawn costs seconds on 2 cores)."""
    return launch.spawn(workers.ddp_suite, world_size, timeout=300)


def _param_bytes():
    return 4 * tiny.num_params(tiny.build(tiny.GPTConfig(), seed=0))


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3])
def test_hand_ddp_equals_torch_ddp_and_one_process(world_size):
    steps = 3
    results = [r["run"] for r in suite(world_size)]
    for r in results:
        assert r["max_param_diff_vs_torch_ddp"] < TOL
        assert r["max_param_diff_vs_single_process"] < TOL
        assert r["allreduce_calls"] == 3 * r["buckets"] and r["buckets"] > 1
        # every gradient handed to an all-reduce exactly once per step (a bucket launched twice or
        # never would change this), counted from the tensors the calls were made with
        assert r["allreduce_payload_bytes"] == steps * _param_bytes()
        assert r["allreduce_counted_bytes"] == 0  # library all-reduces: formula and wire bytes only
    # what gloo wrote during training is the ring payload plus its preambles, call by call: the
    # window around the training loop caught all-reduce traffic and nothing else
    expected = sum(wire.gloo_allreduce_all_ranks(m, world_size) for m in results[0]["allreduce_payloads"])
    assert sum(r["allreduce_wire_bytes"] for r in results) == expected
    assert all(r["wire_reason"] is None for r in results)


@pytest.mark.numerics
def test_no_sync_divides_the_all_reduces_by_the_accumulation_factor_and_counted_rings_agree():
    steps, accumulation, n = 2, 3, 3
    with_no_sync = [r["no_sync_counted"] for r in suite(n)]
    without = suite(2)[0]["no_sync_off"]
    quiet = with_no_sync[0]
    assert quiet["max_param_diff_vs_single_process"] < TOL and quiet["max_param_diff_vs_torch_ddp"] < TOL
    assert without["max_param_diff_vs_single_process"] < TOL  # same result, just more traffic
    assert quiet["allreduce_calls"] == steps * quiet["buckets"]
    assert without["allreduce_calls"] == accumulation * without["buckets"] * steps
    assert without["allreduce_payload_bytes"] == accumulation * steps * _param_bytes()
    # counted=True: hand rings, every message counted; each rank sends its ring share of each bucket
    for rank, r in enumerate(with_no_sync):
        assert r["allreduce_formula_bytes"] == 0
        assert r["allreduce_counted_bytes"] == sum(4 * comm.ring_allreduce_elements(m // 4, n, rank)
                                                   for m in r["allreduce_payloads"])


@pytest.mark.numerics
def test_two_backwards_mixed_dtypes_frozen_and_unused_parameters_match_torch_ddp():
    """Two backward() per step, a bf16 layer first in backward's order, a frozen layer, a branch
    unused on some ranks (step 1) and on all (step 2), against torch DDP(find_unused_parameters=True).

    At 2 ranks, both divide by 2 (exact) and add two numbers (commutative), so any correct DDP
    gives torch's parameters bit for bit; reducing the fp32 gradients in bf16 (a bucket typed by
    its first parameter) or keeping one backward of two moves them by 1e-3 or more.
    """
    for r in (x["semantics"] for x in suite(2)):
        assert r["fp32_vs_torch_ddp"] == 0.0 and r["bf16_vs_torch_ddp"] == 0.0
        # backward's order: the bf16 head first
        assert r["bucket_dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert r["frozen_unchanged"]
        assert r["bad_cap_error"] == "bucket_cap_bytes must be at least 1, got 0."


@pytest.mark.numerics
def test_two_backwards_and_unused_parameters_match_one_process_at_three_ranks():
    # all fp32 here: sums in another order, a few ulps (see TOL); dropping the second backward's
    # gradients was measured at 3.29 away from one process
    for r in (x["semantics"] for x in suite(3)):
        assert r["fp32_vs_torch_ddp"] < TOL and r["fp32_vs_single"] < TOL


@pytest.mark.numerics
def test_replicas_drift_without_sync_and_stay_apart_after():
    r = suite(3)[0]["drift"]
    spread, off = r["spread"], r["steps_off"]
    # step 0: the same initial weights and the same all-reduced gradient on every replica, the same
    # operations on the same shapes: identical bits, not merely close
    assert spread[0] == 0.0 and spread[off] > 1e-3
    # With sync back on every replica takes the same SGD step, so the gap neither closes nor grows
    # (up to fp32 rounding of the parameters, ~1e-7).
    assert all(abs(s - spread[off]) < 1e-5 for s in spread[off:])


def test_overlap_on_and_off_are_measured_and_off_starts_nothing_during_backward():
    """No timing is asserted (2 shared cores); only the order of events, which is structural."""
    r = suite(2)[0]["overlap"]
    assert r["buckets"] > 1
    for mode in ("on", "off"):
        assert set(r[mode]) == {"step_s", "backward_s", "exposed_comm_s", "first_start_s", "timeline",
                                "step_all_s", "backward_all_s", "exposed_all_s", "done_after_backward",
                                "held_to_end", "launched_early", "left_running"}
        assert len(r[mode]["first_start_s"]) == len(r[mode]["step_all_s"]) == 2
        # buckets stamped done after backward ended, per step: a count, never more than the buckets
        assert len(r[mode]["done_after_backward"]) == 2
        assert all(0 <= k <= r["buckets"] for k in r[mode]["done_after_backward"])
        assert r[mode]["backward_s"] == statistics.median(r[mode]["backward_all_s"])
        assert r[mode]["exposed_comm_s"] == statistics.median(r[mode]["exposed_all_s"])
        # the paired times the chapter's interval is built from: the median is theirs
        assert r[mode]["step_s"] == statistics.median(r[mode]["step_all_s"])
    # off: every all-reduce starts after autograd's last gradient; on: the first bucket's starts
    # inside backward, from its hook, while the earlier layers' gradients are still being computed
    assert all(t >= 0 for t in r["off"]["first_start_s"])
    assert all(t < 0 for t in r["on"]["first_start_s"])
    # and not the first bucket alone: every bucket, the last included, starts from a hook
    assert all(k == 0 for k in r["on"]["held_to_end"])
    assert all(k == r["buckets"] for k in r["off"]["held_to_end"])
    assert all(k == 0 for k in r["off"]["left_running"])
    # every bucket but the last to fill launched while backward still had gradients to compute:
    # fixed by the order of the hooks, so asserted exactly, on every rank; none with overlap off
    for rank in suite(2):
        assert all(k == r["buckets"] - 1 for k in rank["overlap"]["on"]["launched_early"])
        assert all(k == 0 for k in rank["overlap"]["off"]["launched_early"])
    assert r["step_ratio_off_over_on"] == r["off"]["step_s"] / r["on"]["step_s"]
    assert hand_ddp.exposed_comm([{"done": 3.0}, {"done": 5.0}], backward_end=4.0) == 1.0
    assert hand_ddp.exposed_comm([{"done": 3.0}], backward_end=4.0) == 0.0


def test_timeline_orders_each_bucket():
    r = suite(2)[0]["overlap"]
    off, on = r["off"]["timeline"], r["on"]["timeline"]
    assert len(off["buckets"]) == len(on["buckets"]) == r["buckets"] > 1
    for b in off["buckets"]:  # overlap off: ready during backward, all-reduced after it
        assert 0 <= b["ready"] <= off["backward_end"] <= b["start"] <= b["done"] <= off["finish_end"]
    for b in on["buckets"]:   # overlap on: launched when ready, done before the gradients are handed back
        assert 0 <= b["ready"] <= b["start"] <= b["done"] <= on["finish_end"]
    for t in (off, on):
        assert t["exposed_comm"] == max(0.0, max(b["done"] for b in t["buckets"]) - t["backward_end"])


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.data_parallel.ddp", "--world-size", "2", "--steps", "2",
                          "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=180, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["max_param_diff_vs_torch_ddp"] < TOL and r["max_param_diff_vs_single_process"] < TOL
    assert r["allreduce_calls"] == 2 * r["buckets"]
    assert r["allreduce_formula_bytes"] > 0 and len(r["allreduce_wire_bytes"]) == 2


def test_waiting_for_each_all_reduce_inside_its_hook_is_caught():
    """Referee, chapter 2 (fix 5) item 1: the start stamps alone passed a DDP that launched each
    bucket from its hook and waited for it there, so that nothing ran under backward's compute.
    The chapter's check (`ddp.overlapped_steps`, over the ranks' exact ``running`` flags) refuses
    it in every step, and passes the overlapping DDP in every step."""
    from labs.data_parallel import ddp
    ranks = suite(2)
    assert any(ddp.overlapped_steps([r["overlap"] for r in ranks]))  # how many: load-dependent
    waits = [r["overlap_waits"] for r in ranks]
    assert not any(ddp.overlapped_steps(waits))
    for r in waits:  # the old checks could not tell: it starts every bucket inside backward too
        assert all(t < 0 for t in r["on"]["first_start_s"]) and all(k == 0 for k in r["on"]["held_to_end"])
    # the flags over two ranks: a step counts where either rank resumed backward under an all-reduce
    one = {"on": {"left_running": [0, 2, 0]}}
    other = {"on": {"left_running": [1, 0, 0]}}
    assert ddp.overlapped_steps([one, other]) == [True, True, False]
    # the last bucket to fill has no gradient work left to run under, and overlap off none at all
    tl = [{"ready": 0.5, "start": 1.0, "running": False}, {"ready": 1.5, "start": 2.0, "running": True},
          {"ready": 9.0, "start": 9.0, "running": True}]
    assert ddp.left_running(tl) == 1 and ddp.launched_early(tl) == 2
    late = [dict(b, start=9.5) for b in tl]        # everything launched once the last bucket filled
    assert ddp.left_running(late) == 0 and ddp.launched_early(late) == 0


def test_deferring_every_launch_to_the_last_gradient_is_caught():
    """Referee, chapter 2 (fix 6) MEDIUM 1: a DDP that launches nothing until every bucket is full,
    then all four buckets from the last gradient's hook (``defer_launch=True``), passed the checks
    of fix 5: no bucket started after autograd ended and every launch left an all-reduce running.
    Overlap means a launch while backward still has gradients to compute: `ddp.launched_early`
    (launch before the last bucket fills, from the order of the hooks) refuses it on every rank in
    every step, and so `ddp.overlapped_steps` does; the real DDP passes both in every step."""
    from labs.data_parallel import ddp
    ranks = suite(2)
    defers = [r["overlap_defers"] for r in ranks]
    for r in defers:  # what fix 5 checked: it passed
        assert all(k == 0 for k in r["on"]["held_to_end"]) and all(t < 0 for t in r["on"]["first_start_s"])
        assert all(k == 0 for k in r["on"]["launched_early"])   # what overlap means: refused
    assert not any(ddp.overlapped_steps(defers))
    waits = [r["overlap_waits"] for r in ranks]   # the other named mistake launches early, then waits
    assert all(k == r["buckets"] - 1 for r in waits for k in r["on"]["launched_early"])
    assert any(ddp.overlapped_steps([r["overlap"] for r in ranks]))  # how many: load-dependent


def test_holding_every_bucket_but_the_first_until_backward_ends_is_caught():
    """Referee, chapter 2 item 6: the old check asked only that the earliest all-reduce start inside
    backward, so a DDP that launched bucket 0 from its hook and held every other bucket until
    autograd ended passed it. `ddp.held_to_end` counts the buckets that started only once backward
    had ended; the chapter asserts 0 with overlap on (the last bucket starts from its hook too)."""
    from labs.data_parallel import ddp
    end = 10.0
    held = [{"start": 2.0}, {"start": 10.0}, {"start": 10.5}, {"start": 11.0}]   # the named mistake
    assert min(b["start"] for b in held) - end < 0              # the old check: it passed
    assert ddp.held_to_end(held, end) == 3                       # the new one: refused (> 0)
    last_held = [{"start": 2.0}, {"start": 5.0}, {"start": 8.0}, {"start": 10.0}]
    assert ddp.held_to_end(last_held, end) == 1                  # refused too: the last bucket held
    assert ddp.held_to_end([{"start": 1.0}, {"start": 9.9}], end) == 0
