"""Chapter 15's practitioner pieces: torch.profiler's schedule in a training loop on 2 gloo ranks, the
ranks' traces merged, and the CPU memory snapshot in the memory viewer's format."""
import json
import pickle

import pytest
import torch

from labs import model as gpt
from labs.launcher import launch
from labs.measure import memory, memory_snapshot
from labs.profiling import practice


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("practice"))
    return folder, launch.spawn(practice.profile_loop, 2, folder, wait=1, warmup=1, active=2, timeout=120)


def test_schedule_records_exactly_the_active_steps(loop):
    _, out = loop
    assert practice.scheduled_active(1, 1, 2) == [2, 3]
    for r in out:
        assert r["steps_run"] == 4
        assert r["traced_steps"] == [2, 3]        # wait (step 0) and warmup (step 1) leave nothing
        assert r["ready_at"] == [4]               # on_trace_ready once, after the last active step
        assert len(r["tensorboard_files"]) == 1   # tensorboard_trace_handler's <worker>.<time>.pt.trace.json
        assert {p: v["count"] for p, v in r["phases"].items()} == dict.fromkeys(practice.PHASES, 2)
        assert r["stack_frames"] > 0              # with_stack: python_function events in the trace
        assert "Self CPU" in r["table"] and len(r["rows"]) == 8   # key_averages().table, row_limit 8
        # DDP's all-reduce is in the trace; whether it makes the table's top 8 depends on the load
        names = {e.get("name", "") for e in json.load(open(r["path"]))["traceEvents"]}
        assert any("allreduce" in n for n in names), sorted(names)[:20]


def test_export_chrome_trace_handler_writes_one_file_of_a_fixed_name(tmp_path):
    """The page's other handler, `lambda p: p.export_chrome_trace(path)`: one file per rank at the
    name given, the same two active steps, and no TensorBoard files. Catches the handler ignored (the
    TensorBoard one used whatever is asked) or called at every step."""
    folder = str(tmp_path)
    out = launch.spawn(practice.profile_loop, 2, folder, wait=1, warmup=1, active=2, handler="chrome",
                       timeout=120)
    for r in out:
        assert r["path"] == f"{folder}/rank{r['rank']}.pt.trace.json"
        assert r["traced_steps"] == [2, 3] and r["ready_at"] == [4]
        assert r["tensorboard_files"] == []


def test_merged_trace_has_both_ranks_with_distinct_pids(loop, tmp_path):
    _, out = loop
    merged = practice.merge_traces([r["path"] for r in out], str(tmp_path / "merged.json"))
    assert merged["ranks"] == [0, 1]
    events = json.load(open(merged["path"]))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        mine = [e["name"] for e in events if e["pid"] == rank]
        steps = sorted(n for n in mine if n.startswith("ProfilerStep#"))
        assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
        assert any(n.startswith("gloo:") for n in mine)
    with pytest.raises(ValueError):
        practice.merge_traces([out[0]["path"], out[0]["path"]], str(tmp_path / "twice.json"))


def _step(m, opt, x, y):
    loss = m(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_snapshot_peak_is_the_accounting_peak_to_the_byte(tmp_path):
    cfg = gpt.GPTConfig()
    m = gpt.build(cfg)
    opt = torch.optim.AdamW(m.parameters())
    x, y = gpt.synthetic_batch(cfg, 4, seed=0)
    _step(m, opt, x, y)   # the optimizer's state exists from here on
    with memory_snapshot.Recorder(m, opt) as rec:
        _step(m, opt, x, y)
    with memory.PeakMemory(m, opt) as ref:
        _step(m, opt, x, y)
    snap = pickle.load(open(rec.dump(str(tmp_path / "snapshot.pickle")), "rb"))
    live = memory_snapshot.replay(snap)
    assert memory_snapshot.replay_peak(snap) == rec.peak_bytes == ref.peak_bytes
    assert live[0] == rec.baseline_bytes and live[-1] == rec.end_bytes
    assert memory_snapshot.lost(snap, rec) == []
    assert len(snap["device_traces"][0]) == 2 * rec.allocations + 3 * rec.frees
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert actions == {"segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"}
    assert all(b["state"] == "active_allocated" for s in snap["segments"] for b in s["blocks"])
    assert any(e["frames"][0]["name"].startswith("aten.mm") for e in snap["device_traces"][0])


def _without_transients(snap):
    """The snapshot with every block that is allocated and freed on one side of the peak dropped:
    start, end and peak unchanged, most of the events gone."""
    events = snap["device_traces"][0]
    live, best, at = memory_snapshot.replay(snap)[0], None, None
    born, gone = {}, {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live += e["size"]
            born[e["addr"]] = i
        elif e["action"] == "free_completed":
            live -= e["size"]
            gone[e["addr"]] = i
        if e["action"] in ("alloc", "free_completed") and (best is None or live > best):
            best, at = live, i
    drop = {a for a, i in born.items() if a in gone and (gone[a] < at or i > at)}
    kept = [e for e in events if e["addr"] not in drop]
    return {"segments": snap["segments"], "device_traces": [kept]}, len(drop)


def test_a_snapshot_that_drops_short_lived_blocks_is_caught():
    cfg = gpt.GPTConfig()
    m = gpt.build(cfg, seed=0)
    opt = torch.optim.AdamW(m.parameters())
    x, y = gpt.synthetic_batch(cfg, 4, seed=0)
    _step(m, opt, x, y)
    with memory_snapshot.Recorder(m, opt) as rec:
        _step(m, opt, x, y)
    snap = rec.snapshot()
    thin, dropped = _without_transients(snap)
    live = memory_snapshot.replay(thin)
    assert dropped > 0
    # start, end and peak alone cannot see it ...
    assert (live[0], live[-1], max(live)) == (rec.baseline_bytes, rec.end_bytes, rec.peak_bytes)
    # ... the event count and the whole curve can
    problems = memory_snapshot.lost(thin, rec)
    assert any("events" in p for p in problems) and any("curve" in p for p in problems), problems
    # a file that keeps every block but drops the segment events fails on the count alone
    bare = [e for e in snap["device_traces"][0] if e["action"] != "segment_free"]
    problems = memory_snapshot.lost({"segments": snap["segments"], "device_traces": [bare]}, rec)
    assert len(problems) == 1 and "events" in problems[0], problems


def test_the_pages_loop_is_the_labs():
    """Chapter 15 shows `profile_loop` cut to its profiler calls. Catches the page's snippet drifting
    from the code it quotes: a phase renamed, a schedule or handler changed on one side only."""
    import inspect
    import os
    import re
    import textwrap
    page = open(os.path.join(os.path.dirname(__file__), "..", "book", "15-profiling.md")).read()
    (snippet,) = re.findall(r"```python\n(.*?)```", page, re.S)
    flat = re.sub(r"\(\s+", "(", re.sub(r"\s+", " ", snippet))     # the calls as one line each
    source = inspect.getsource(practice)
    assert re.findall(r'record_function\("([^"]+)"\)', snippet) == list(practice.PHASES)
    defaults = inspect.signature(practice.profile_loop).parameters
    wait, warmup, active = (defaults[k].default for k in ("wait", "warmup", "active"))
    assert f"schedule(wait={wait}, warmup={warmup}, active={active})" in flat
    assert f"range({practice.total_steps(wait, warmup, active)})" in snippet
    for call in ("tensorboard_trace_handler(", "record_shapes=True", "prof.step()",
                 "opt.zero_grad(set_to_none=True)", "loss.backward()"):
        assert call in snippet and call in source, call
    sort_by, rows = defaults["sort_by"].default, defaults["row_limit"].default
    assert f'table(sort_by="{sort_by}", row_limit={rows})' in flat
    compile(textwrap.dedent(snippet), "snippet", "exec")          # it parses as Python
