"""Chapter 5: every schedule computes one process's gradients, with the formula's bubble and the
activation bytes its action list implies; ZB-H1 is the paper's, and its B and W split the FLOPs."""
import json
import os
import subprocess
import sys

import pytest
import torch

from labs.launcher import launch
from labs import model as tiny
from labs.formulas import schedules
from labs.pipeline import executor, torch_pipelining, split_backward

# The tests marked `numerics` compare floating-point results: `make test` runs them under
# another CPU's rounding. The others compare bytes, counts, schedules or refusals.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32 gradients of m micro-batches summed one by one vs one backward over the whole batch:
# a few ulps of gradients of order 1e-2; a lost or doubled micro-batch errs by order 1e-2.
TOL = 1e-6
# One job per world size runs every case (a spawn costs about 1 s per process on 2 cores).
# m < p and m >= p for each schedule; m = 5 >= 2p - 1 lets the greedy schedule reach its peak.
CONFIGS = {p: [("gpipe", 4, 1), ("gpipe", 2, 1), ("1f1b", 5, 1), ("1f1b", 2, 1), ("zb-h1", 5, 1),
               ("zb-h1", 2, 1), ("greedy-bfw", 5, 1), ("interleaved", 2 * p, 2)] for p in (2, 3)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: in this process, as in the spawned ranks, one thread (two threads on two shared
    cores run these small matmuls tens of times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cases():
    for p in (2, 3, 4):
        for m in range(1, 3 * p + 1):
            for name in ("gpipe", "1f1b", "zb-h1", "greedy-bfw"):
                yield name, p, m, 1
            if m % p == 0:
                yield "interleaved", p, m, 2


@pytest.mark.parametrize("name,p,m,v", list(_cases()))
def test_simulated_bubble_equals_the_formula(name, p, m, v):
    lists = schedules.build(name, p, m, v)
    cost = schedules.costs(name, v)
    timeline = schedules.simulate(lists, cost, v)
    # every stage does all its work, m x v chunk-passes of F + B (+ W), not only stage 0
    assert schedules.stage_busy(timeline) == pytest.approx([m * v * sum(cost.values())] * p, abs=1e-12)
    measured = schedules.bubble(timeline, cost)
    assert measured["over_ideal"] == pytest.approx(schedules.formula(name, p, m, v)["over_ideal"], abs=1e-12)


def test_a_dropped_w_on_a_later_stage_is_caught():
    # Named mistake: the builder drops the last W on stage p - 1 of ZB-H1. Stage 0 still ends the
    # step, so its busy time and the bubble equal the formula; only the per-stage busy time differs.
    p, m = 4, 8
    lists = schedules.zb_h1(p, m)
    lists[p - 1] = lists[p - 1][:-1]
    cost = schedules.costs("zb-h1")
    timeline = schedules.simulate(lists, cost)
    assert schedules.bubble(timeline, cost)["over_ideal"] == pytest.approx(
        schedules.formula("zb-h1", p, m)["over_ideal"], abs=1e-12)
    busy = schedules.stage_busy(timeline)
    assert busy[p - 1] == pytest.approx(m * 3 - 1) and busy[:p - 1] == pytest.approx([m * 3] * (p - 1))


@pytest.mark.parametrize("p,m", [(2, 1), (3, 2), (3, 7), (4, 8)])
def test_peak_in_flight(p, m):
    def peaks(lists):
        return [schedules.peak_inflight(a) for a in lists]
    assert peaks(schedules.gpipe(p, m)) == [m] * p
    assert peaks(schedules.one_f_one_b(p, m)) == [min(p - s, m) for s in range(p)]
    assert peaks(schedules.zb_h1(p, m)) == [min(p, m)] * p           # Qi et al. §2.1: p on every stage
    assert peaks(schedules.greedy_bfw(p, m)) == [min(2 * p - 1 - s, m) for s in range(p)]


def test_zb_h1_is_the_papers_figure_3():
    # Qi et al. 2024, Figure 3 (top), p = 4, m = 8: each character is one unit of time, the
    # micro-batch (1-based) of the F, B or W run then, "." an idle unit.
    figure = ["1234...11522633744855667788",
              ".123..142153264375486576878",
              "..12.1324315426537648758678",
              "...112233441552663774885678"]
    timeline = schedules.simulate(schedules.zb_h1(4, 8), {"F": 1, "B": 1, "W": 1})
    rows = []
    for stage in timeline:
        row = ["."] * int(stage[-1][2])
        for a, start, _ in stage:
            row[int(start)] = str(a.mb + 1)
        rows.append("".join(row))
    assert rows == figure


@pytest.fixture(scope="module")
def costs():
    return split_backward.costs(executor.config(), batch_size=2)


@pytest.mark.numerics
def test_zb_h1_bubble_with_table_1_times(costs):
    # Qi et al. Table 2 for any T_F, T_B, T_W with T_W <= min(T_F, T_B): ZB-H1's bubble is (p-1)(T_F+T_B-T_W),
    # 1F1B's (p-1)(T_F+T_B+T_W). Times here: the FLOPs of one layer's F, B and W, counted.
    layer = costs["layer"]
    tf, tb, tw = layer["flops_forward"], layer["flops_backward_input"], layer["flops_backward_weight"]
    for p in (2, 3, 5):
        for m in (p, p + 1, 3 * p):
            for lists, cost, bubble in [(schedules.zb_h1(p, m), {"F": tf, "B": tb, "W": tw}, tf + tb - tw),
                                        (schedules.one_f_one_b(p, m), {"F": tf, "B": tb + tw, "W": 0},
                                         tf + tb + tw)]:
                total = max(t[-1][2] for t in schedules.simulate(lists, cost))
                assert total - m * (tf + tb + tw) == (p - 1) * bubble


@pytest.mark.numerics
def test_split_backward_counts_and_gradients(costs):
    cfg, b = executor.config(), 2
    s, h, a = cfg.seq_len, cfg.hidden, cfg.n_head
    layer, model = costs["layer"], costs["model"]
    # Qi et al. Table 1 (matmul FLOPs per layer), counted here by FlopCounterMode: W recomputes
    # nothing, and B and W are the full backward's two halves (integer counts: exact).
    assert layer["flops_forward"] == s * b * h * (24 * h + 4 * s)
    assert layer["flops_backward_input"] == s * b * h * (24 * h + 8 * s)
    assert layer["flops_backward_weight"] == s * b * h * 24 * h
    for c in (layer, model):   # the model adds the embeddings and the head, a deferred linear layer
        assert c["flops_backward_input"] + c["flops_backward_weight"] == c["flops_backward_full"]
    assert costs["flops_split_error"] == 0   # FLOP counts are integers: exact
    assert {k: layer[k] for k in costs["table_1"]} == costs["table_1"]   # the lab's own Table 1 column
    # After B autograd holds nothing of the layer: W's store is x and dy of its four linear layers,
    # (h + h + h + 4h) + (3h + h + 4h + h) = 16 values per token, Table 1's 32sbh bytes in 16-bit.
    assert layer["activation_bytes_W"] == 16 * s * b * h * 4
    # Until B (fp32, no dropout): 16sbh (Korthikanti et al. 2022 without masks) + softmax as^2b
    # + LayerNorm's mean and 1/std, 2 x 2 values per token.
    assert layer["activation_bytes_F"] == 4 * (16 * s * b * h + a * s * s * b + 4 * s * b)

    net_full, net_split = tiny.build(cfg, seed=0), tiny.build(cfg, seed=0)
    x, y = tiny.synthetic_batch(cfg, b, seed=0)
    net_full(x, y).backward()
    store = []
    with split_backward.deferring(net_split, store):
        net_split(x, y).backward()
    assert net_split.head.weight.grad is None and net_split.blocks[0].ln1.weight.grad is not None
    split_backward.weight_grads(store)
    for (n, p_full), p_split in zip(net_full.named_parameters(), net_split.parameters()):
        # dy^T x summed in another order than autograd's mm: a few fp32 ulps at most
        torch.testing.assert_close(p_split.grad, p_full.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="m=5 is not a multiple of p=2; use m=6"):
        schedules.build("interleaved", 2, 5, 2)
    with pytest.raises(ValueError, match="applies to the interleaved schedule only"):
        schedules.build("zb-h1", 2, 4, 2)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        schedules.build("zb", 2, 4)
    with pytest.raises(ValueError, match="do not split into p\\*v = 5"):
        executor.split(executor.tiny.build(executor.config()), 5)
    with pytest.raises(ValueError, match="no counterpart of 'greedy-bfw'"):
        torch_pipelining.library(0, 2, "greedy-bfw")
    with pytest.raises(ValueError, match="exactly two chunks per rank"):
        torch_pipelining.library(0, 2, "zb-v", 4, 1)


def _peak_bytes(actions, chunks, split):
    """What a stage should hold at its peak, from its action list and each chunk's measured bytes
    for one micro-batch: F adds what autograd saves; B frees it and, split, keeps W's store."""
    held = peak = 0
    for a in actions:
        c = chunks[a.chunk]
        held += {"F": c["activation_bytes_F"], "W": -c["activation_bytes_W"],
                 "B": -c["activation_bytes_F"] + (c["activation_bytes_W"] if split else 0)}[a.kind]
        peak = max(peak, held)
    return peak


@pytest.fixture(scope="module")
def runs():
    return {p: {(r["schedule"], r["microbatches"]): r
                for r in launch.spawn(executor.sweep, p, CONFIGS[p], 0.0, timeout=300)[0]} for p in CONFIGS}


@pytest.mark.numerics
def test_executor_gradients_bubble_and_activation_bytes(runs):
    for p, results in runs.items():
        for (name, m), r in results.items():
            lists = schedules.build(name, p, m, r["chunks"])
            case = f"{name} p={p} m={m}"
            assert r["max_abs_error_grad"] < TOL, case
            # the logical clocks travel with the real messages, so this is the executed timeline's bubble
            assert r["bubble_fraction"] == pytest.approx(r["bubble_fraction_formula"], abs=1e-12), case
            assert r["peak_inflight"] == [schedules.peak_inflight(a) for a in lists], case
            # bytes held after each action, measured by liveness, against the bytes the list implies:
            # a B that kept the graph (retain_graph) or a store never emptied would exceed these
            split = name in schedules.SPLIT
            want = [_peak_bytes(a, c, split) for a, c in zip(lists, r["piece_costs"])]
            assert r["activation_bytes_peak"] == want, case


@pytest.mark.numerics
def test_1f1b_stage_0_holds_all_layers_and_zb_h1_keeps_its_peak(runs):
    cfg = executor.config()
    tokens, _ = executor.microbatches(cfg, 1, 2)[0]
    # the first piece's embeddings also save their indices: the tokens' storage and the positions
    indices = tokens.untyped_storage().nbytes() + cfg.seq_len * 8
    for p, results in runs.items():
        one, zb, greedy = results[("1f1b", 5)], results[("zb-h1", 5)], results[("greedy-bfw", 5)]
        per_layer, first = one["layer"]["activation_bytes_F"], one["piece_costs"][0][0]
        # p micro-batches of L/p layers on stage 0: L layers' worth, whatever p is
        assert one["activation_bytes_peak"][0] == p * first["activation_bytes_F"]
        assert one["activation_bytes_peak"][0] == cfg.n_layer * per_layer + p * indices
        # ZB-H1 (Qi et al. §2.1; the counts in §2.3): stage s holds (p - s) M_B + s M_W, below stage 0's p M_B
        assert zb["activation_bytes_peak"] == [(p - s) * c[0]["activation_bytes_F"] + s
                                               * c[0]["activation_bytes_W"]
                                               for s, c in enumerate(zb["piece_costs"])]
        assert (max(zb["activation_bytes_peak"]) == zb["activation_bytes_peak"][0]
                == one["activation_bytes_peak"][0])
        # the greedy schedule holds p - 1 more micro-batches' W store on stage 0, for the same bubble
        assert (greedy["activation_bytes_peak"][0] == one["activation_bytes_peak"][0] + (p - 1)
                * first["activation_bytes_W"])
        assert greedy["bubble_fraction"] == zb["bubble_fraction"]


@pytest.mark.numerics
def test_torch_pipelining_gives_the_same_gradients():
    from labs.pipeline import v_schedules
    configs = [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2), ("zb-h1", 4, 2),
               ("zb-v", 4, 2), ("dualpipe-v", 4, 2)]
    results = launch.spawn(torch_pipelining.libraries, 2, configs, timeout=180)
    for i, (name, m, _) in enumerate(configs):
        assert max(r[i]["max_abs_error_grad"] for r in results) < TOL, name
        if name in v_schedules.CLASSES:   # the order simulated is the order the library ran
            flat = [[a for step in rank for a in step] for rank in v_schedules.library_order(name, 2, m)]
            assert results[0][i]["order"] == flat, name


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.pipeline.executor", "--world-size", "2", "--schedule",
                          "zb-h1", "--microbatches", "3", "--unit-ms", "5", "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=180, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["max_abs_error_grad"] < TOL and r["peak_inflight"] == [2, 2]
    # (p-1)/(3m) = 1/9 of ideal is 1/10 of the total
    assert r["bubble_fraction"] == pytest.approx(r["bubble_fraction_formula"]) == pytest.approx(1 / 10)
    assert r["activation_bytes_peak"][0] == 2 * r["piece_costs"][0][0]["activation_bytes_F"]
    bad = subprocess.run([sys.executable, "-m", "labs.pipeline.executor", "--world-size", "2", "--schedule",
                          "interleaved", "--microbatches", "5", "--chunks", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not a multiple of p=2" in bad.stderr and "Traceback" not in bad.stderr


def test_microbatches_to_halve_the_bubble_share():
    """(p-1)/(m'+p-1) <= half of (p-1)/(m+p-1) first at m' = 2m + p - 1: counted, not assumed."""
    from labs.formulas import schedules
    for p, m in ((4, 12), (8, 8), (16, 48), (2, 1)):
        assert schedules.microbatches_to_halve(p, m) == 2 * m + p - 1, (p, m)


def test_wall_bubble_counts_a_sleeps_overshoot_as_idle_not_busy():
    # Two stages, one action each, padded to 1.0 s; stage 0's sleep overshoots by 0.3 s (a loaded
    # machine), so stage 1 starts at 1.3 s. The dependencies force each stage to idle 1 s of 2:
    # a bubble of at least 0.5. Busy as wall_end - wall_start (1.3 s) gave 1 - 1.3/2.3 = 0.43,
    # below what any correct executor can idle; busy as the padded duration gives 1 - 1/2.3.
    events = [[{"wall_start": 0.0, "wall_end": 1.3, "wall_work": 1.0}],
              [{"wall_start": 1.3, "wall_end": 2.3, "wall_work": 1.0}]]
    assert executor.wall_bubble(events) == pytest.approx(1 - 1.0 / 2.3)
    assert executor.wall_bubble(events) >= 0.5


class _Overrunning(executor.Executor):
    """`Executor.run` with the model taken out: each action's "compute" is a sleep of ``overrun``
    times its nominal work (a loaded machine), messages are queues between two threads."""

    def __init__(self, rank, unit, inbox, overrun):
        import types
        self.rank, self.p, self.v, self.lock, self.unit, self.overrun = rank, 2, 1, None, unit, overrun
        self.cost, self.inbox = schedules.costs("1f1b"), inbox
        self.activations = types.SimpleNamespace(held_bytes=lambda stores: 0)
        self.saved, self.pending, self.events = {}, [], []
        self.clock, self.peak, self.peak_bytes = 0.0, 0, 0

    def _work(self, a, receives):
        import time
        ready = self.clock
        if receives:
            ready = self.inbox[self.rank].get()
            self.wall0 = time.perf_counter()
        time.sleep(self.overrun * self.cost[a.kind] * self.unit)
        return ready

    def _F(self, a, k):
        return self._work(a, k > 0)

    def _B(self, a, k):
        return self._work(a, k < self.p - 1)

    def _finish_message(self, a, k):
        if a.kind == "F" and k == 0:
            self.inbox[1].put(self.clock)
        elif a.kind == "B" and k == 1:
            self.inbox[0].put(self.clock)


@pytest.mark.timed
def test_wall_bubble_not_below_formula_when_compute_overruns_the_padding():
    # Stage 0's compute takes 1.5x its padded duration (load), stage 1's exactly its padding. Busy
    # counted as max(compute, padding) inflated stage 0's busy time more than the wall and put the
    # bubble below the formula; busy as the nominal work cannot.
    import queue
    import threading
    p, m, unit = 2, 2, 0.02
    inbox = [queue.Queue(), queue.Queue()]
    stages = [_Overrunning(0, unit, inbox, 1.5), _Overrunning(1, unit, inbox, 1.0)]
    lists = schedules.build("1f1b", p, m)
    threads = [threading.Thread(target=s.run, args=(lists[s.rank],)) for s in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    formula = schedules.formula("1f1b", p, m)["over_total"]
    events = [s.events for s in stages]
    assert all(e["wall_end"] - e["wall_start"] > e["wall_work"] for e in events[0])  # overran
    assert executor.wall_bubble(events) >= formula
    # what max(compute, padding) would have counted: below the formula
    inflated = [[e | {"wall_work": e["wall_end"] - e["wall_start"]} for e in evs] for evs in events]
    assert executor.wall_bubble(inflated) < formula


def test_overlap_counts_time_with_two_stages_busy():
    from labs.pipeline import wall_clock
    def ev(a, b):
        return {"wall_start": a, "wall_work": b - a}
    assert wall_clock.overlap([[ev(0, 2)], [ev(1, 3)]]) == pytest.approx(1.0)
    assert wall_clock.overlap([[ev(0, 1)], [ev(1, 2)], [ev(2, 3)]]) == 0.0   # one at a time


@pytest.mark.timed
def test_wall_clock_check_fails_the_planted_serialisation():
    """The planted bug (every stage's work under one lock) fails `wall_clock.check` on every run:
    no two stages ever work at once, whatever the load; the correct run beside it passes."""
    from labs.pipeline import wall_clock
    (run, serialised), = wall_clock.paired(2, [("1f1b", 3, 1)], 0.01, timeout=180)
    assert wall_clock.overlap(serialised["events"]) == 0.0
    assert serialised["bubble_fraction_wallclock"] >= 1 - 1 / 2     # p stages' work, one at a time
    with pytest.raises(AssertionError, match="no two stages ever worked at the same time"):
        wall_clock.check(serialised, run)
    wall_clock.check(run, serialised)


def test_zb_h1_formula_needs_w_no_longer_than_f_or_b():
    """Qi et al.'s (p-1)(t_F + t_B - t_W) holds for t_W <= min(t_F, t_B) (t_B here is B alone);
    beyond, the simulated idle time stays (p-1) max(t_F, t_B) while the formula keeps falling (the
    chapter states the condition). (1, 0.5, 1): t_W <= t_F but t_W > t_B, where t_W <= t_F alone
    would wrongly predict (p-1) 0.5."""
    for p, m in ((2, 4), (3, 6), (4, 8)):
        for tf, tb, tw in ((2, 1, 1), (1, 1, 1), (1, 1, 1.5), (1, 2, 4), (1, 0.5, 1), (2, 0.5, 1)):
            timeline = schedules.simulate(schedules.zb_h1(p, m), {"F": tf, "B": tb, "W": tw})
            total = max(t[-1][2] for t in timeline)
            assert total - m * (tf + tb + tw) == (p - 1) * (tf + tb - min(tw, tf, tb)), (p, m, tf, tb, tw)
