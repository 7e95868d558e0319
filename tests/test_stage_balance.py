"""Chapter 5: stage imbalance with a real vocabulary, measured per stage; Llama 3 405B's split in FLOPs."""
import pytest
import torch

from labs.pipeline import stage_balance as sb


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield sb.measure(sb.config(hidden=64, n_layer=8), p=4, timed=False)
    torch.set_num_threads(threads)


def test_per_stage_bytes_and_flops(tiny):
    b_s, h, V = tiny["tokens"], tiny["hidden"], tiny["vocab"]
    for stages in tiny["splits"].values():
        layer = stages[1]["activation_bytes"] // stages[1]["layers"]
        for s in stages:
            assert s["flops"] == s["flops_formula"]               # FlopCounterMode == the formula
        last = stages[-1]
        extra = last["activation_bytes"] - last["layers"] * layer
        # fp32 log-probabilities (b s V), ln_f's input and the head's input (b s h each), ln_f's
        # mean and rstd (b s each), the int64 targets (b s) and the loss's total weight
        assert extra == 4 * b_s * V + 8 * b_s * h + 16 * b_s + 4
        assert stages[0]["param_bytes"] - stages[0]["layers"] * tiny["layer_param_bytes"] == 4 * (V + 16) * h
    equal, balanced = tiny["splits"]["equal"], tiny["splits"]["balanced"]
    assert [s["layers"] for s in equal] == [2, 2, 2, 2]
    assert sum(s["layers"] for s in balanced) == 8 and balanced[-1]["layers"] < 2
    assert max(s["flops"] for s in balanced) < max(s["flops"] for s in equal)


def test_llama3_405b_split_and_pace():
    r = sb.llama3_405b(m=16, p=16)
    eq, llama, even = (r["splits"][k] for k in ("equal_128", "llama3_126", "even_126"))
    assert sum(llama["layers"]) == 126 == 16 * 8 - 2 and llama["layers"][0] == llama["layers"][-1] == 7
    assert 0.5 < r["head_in_layers"] < 1                     # the head: less than one layer's FLOPs
    assert eq["slowest"] == [15] and llama["slowest"] == list(range(1, 15))
    for s in (eq, llama, even):
        assert s["pace"] == s["max_stage"]                    # the slowest stage sets the pace
        assert s["step"] <= s["bound"] == s["step_gpipe"]      # GPipe: the flow-shop formula
    assert eq["step"] == eq["bound"]                          # last stage slowest: exact
    assert llama["max_stage"] == 8 * r["layer_flops"] < eq["max_stage"]
    with pytest.raises(ValueError, match="equally"):
        sb.equal(sb.config(n_layer=7), 4)


def test_llama3_405b_like_for_like_126_layers():
    # The split's effect with the layer count held at 126: taking the short stages from the front
    # leaves the last stage 8 layers plus the head, the slowest; Llama 3's split (one fewer on the
    # last stage) is faster than that, and no faster than both short stages last. A comparison
    # against the 128-layer split would credit the split with 2 layers' less work.
    r = sb.llama3_405b(m=16, p=16)
    first, llama, last = (r["splits"][k] for k in ("first_126", "llama3_126", "even_126"))
    assert sum(first["layers"]) == sum(llama["layers"]) == sum(last["layers"]) == 126
    assert first["slowest"] == [15] and first["step"] > llama["step"] >= last["step"]


def test_time_splits_pairs_every_stage_of_both_splits():
    cfg = sb.config(hidden=64, n_layer=8)
    t = sb.time_splits(cfg, p=4, repeats=3)
    assert set(t) == {"equal", "balanced"}
    for runs in t.values():
        assert len(runs) == 3 and all(len(r) == 4 and min(r) > 0 for r in runs)


def test_time_splits_rotates_the_stage_order_so_position_is_not_a_stage(monkeypatch):
    # A fake clock that charges the first stage of every round 10 units and the others 1: a
    # pure position effect. With the order rotated, each stage is first in 2 of 8 rounds and the
    # head's stage over stage 1 is not called; the named mistake, the same order every round
    # (stage 0 first, the head's stage last), charges stage 0 every time and calls it slower.
    import types
    from labs.measure import intervals
    p = 4

    def clock():
        state = {"calls": 0, "t": 0.0}

        def perf_counter():
            c = state["calls"]
            state["calls"] += 1
            if c % 2:                                   # an end: charge by place in the round
                state["t"] += 10.0 if (c // 2) % p == 0 else 1.0
            return state["t"]
        return types.SimpleNamespace(perf_counter=perf_counter)

    cfg = sb.config(hidden=32, n_layer=4, vocab_size=64)
    assert sb.rotation(p, 0) == [0, 1, 2, 3] and sb.rotation(p, 5) == [1, 2, 3, 0]
    monkeypatch.setattr(sb, "time", clock())
    t = sb.time_splits(cfg, p=p, repeats=8)
    for rounds in t.values():
        assert [sum(r[s] == 10.0 for r in rounds) for s in range(p)] == [2] * p
    for num in (0, -1):
        iv = sb.stage_ratio(t["equal"], num, 1)
        assert intervals.verdict(iv, "faster", "slower", machine_cores=2) == intervals.UNRESOLVED
    monkeypatch.setattr(sb, "time", clock())
    monkeypatch.setattr(sb, "rotation", lambda p, k: list(range(p)))   # the named mistake
    t = sb.time_splits(cfg, p=p, repeats=8)
    iv = sb.stage_ratio(t["equal"], 0, 1)
    assert intervals.verdict(iv, "faster", "slower", machine_cores=2) == "slower"


def test_stage_ratio_can_fall_below_one():
    # Four equal stages with noise alone: a pair fixed in advance straddles 1, while the named
    # mistake, each round's slowest stage over its fastest, is >= 1 in every round and calls the
    # equal stages unequal.
    import random
    from labs.measure import intervals
    rng = random.Random(0)
    rounds = [[0.2 * rng.lognormvariate(0, 0.3) for _ in range(4)] for _ in range(15)]
    fixed = sb.stage_ratio(rounds, -1, 1)
    assert fixed["lowest"] < 1 < fixed["highest"] and fixed["low"] < 1 < fixed["high"]
    assert intervals.verdict(fixed, "faster", "slower", machine_cores=2) == intervals.UNRESOLVED
    spread = intervals.ratio_interval([max(t) for t in rounds], [min(t) for t in rounds])
    assert spread["lowest"] >= 1 and spread["low"] > 1
    # a real difference is still seen: the last stage three times as slow
    slow = [t[:-1] + [3 * t[-1]] for t in rounds]
    assert intervals.verdict(sb.stage_ratio(slow, -1, 1), "faster", "slower", machine_cores=2) == "slower"


def test_llama3_405b_head_causal_and_not():
    # the layer's attention term: 4hs per token forward over all s x s scores, 2hs causal
    from labs.memory_budget import compute
    from labs.memory_budget.budget import MODELS
    r = sb.llama3_405b(m=16, p=16)
    a, s = MODELS["405B"], 8192
    block = compute.llama_block_params(a.hidden, a.heads, a.kv_heads, a.ffn)["matmul"]
    head = 2 * a.hidden * a.vocab
    assert r["head_in_layers"] == pytest.approx(head / (2 * block + 4 * a.hidden * s), rel=1e-12)
    assert r["head_in_layers_causal"] == pytest.approx(head / (2 * block + 2 * a.hidden * s), rel=1e-12)
    assert r["head_in_layers"] < r["head_in_layers_causal"] < 1


def test_per_chunk_costs_reproduce_the_interleaved_formula():
    # equal costs given per chunk give the interleaved formula; a list per stage is read per chunk
    from labs.formulas import schedules
    for p, m, v in ((2, 4, 2), (4, 8, 2), (4, 8, 3)):
        cost = [[{"F": 1 / v, "B": 2 / v, "W": 0}] * v for _ in range(p)]
        timeline = schedules.simulate(schedules.build("interleaved", p, m, v), cost, v)
        total = max(e for tl in timeline for _, _, e in tl)
        want = schedules.formula("interleaved", p, m, v)["over_total"]
        assert (total - 3 * m) / total == pytest.approx(want)


def test_llama3_405b_interleaved_v8_keeps_the_plain_1f1b_verdict():
    # Llama 3 runs interleaved, v = 8 (one layer per chunk). On its chunks the verdict of plain 1F1B
    # holds: short chunks first are slower than Llama 3's split, and the layer taken from stage 0
    # buys no time (short chunks last are exactly as fast).
    r = sb.llama3_405b_interleaved(m=16, p=16, v=8)
    first, llama, last = (r["splits"][k] for k in ("first_126", "llama3_126", "even_126"))
    assert sum(first["layers"]) == sum(llama["layers"]) == sum(last["layers"]) == 126
    assert llama["layers"][0] == llama["layers"][-1] == 0
    assert first["step"] > llama["step"] == last["step"]
