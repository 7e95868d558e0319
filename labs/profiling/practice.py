"""Chapter 15: torch.profiler as practitioners put it in a training loop, and several ranks' traces merged.

    out = launch.spawn(practice.profile_loop, 2, folder, wait=1, warmup=1, active=2)
    out[0]["traced_steps"]     # [2, 3]: the steps the schedule recorded, read back from the trace
    print(out[0]["table"])      # key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
    practice.merge_traces(out_paths, "merged.json")   # one file, one process (pid) per rank

The loop is the usual one (`profile_loop`): the profiler is entered once around the whole loop, with
``schedule(wait, warmup, active, repeat)``: the first ``wait`` steps run with the profiler off, the
next ``warmup`` steps with it on but their events thrown away (its start-up costs land there), the
next ``active`` steps recorded; ``prof.step()`` at the end of every step moves the schedule on and
marks each recorded step with a ``ProfilerStep#N`` event. When the active steps are done, the
profiler calls ``on_trace_ready`` with itself: here `tensorboard_trace_handler` (the file TensorBoard's
profiler plugin and HTA read: ``<worker>.<time>.pt.trace.json``) or `export_chrome_trace` for a
file of a fixed name (a trace is saved once: one or the other). ``record_function`` names the
loop's phases (forward, backward, optimizer) so they show as spans in the trace and as rows in
``key_averages()``; ``with_stack=True`` keeps the Python stack of every operator
(``group_by_stack_n`` then splits the table by call site).

Each rank writes its own file, with its own process id; a practitioner reading a multi-rank run
merges them (`merge_traces`): every event of rank r gets pid r and the process is named "rank r".
The ranks' timestamps come from one clock on one machine (the same host here); across machines the
clocks differ by their offset, which a merge must subtract first. HTA 0.5.0 does not: it subtracts
one timestamp, the earliest of all ranks, from every rank (`Trace._align_all_ranks`), so it too
assumes the ranks share a clock.
"""
import glob
import gzip
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from labs import model as gpt

_PROCESS_META = ("process_name", "process_sort_index", "process_labels")
PHASES = ("labs:forward", "labs:backward", "labs:optimizer")


def total_steps(wait, warmup, active, repeat=1, skip_first=0):
    """Steps the loop must run for the schedule to finish: skip_first + (wait+warmup+active)*repeat."""
    return skip_first + (wait + warmup + active) * repeat


def scheduled_active(wait, warmup, active, repeat=1, skip_first=0):
    """The step numbers (0-based) the schedule records, from the schedule itself."""
    s = schedule(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first)
    rec = torch.profiler.ProfilerAction.RECORD, torch.profiler.ProfilerAction.RECORD_AND_SAVE
    return [i for i in range(total_steps(wait, warmup, active, repeat, skip_first)) if s(i) in rec]


def profile_loop(rank, world_size, folder, wait=1, warmup=1, active=2, batch=4, with_stack=True,
                 handler="tensorboard", sort_by="self_cpu_time_total", row_limit=8):
    """On one rank: the tiny model under DDP, trained for the schedule's steps under torch.profiler.

    Returns the chrome trace's path, the steps it recorded (its ``ProfilerStep#N`` events), the
    TensorBoard handler's files, the ``key_averages`` table, its rows as (name, calls, ``sort_by``
    in us), and its rows for the phases."""
    os.makedirs(folder, exist_ok=True)
    cfg = gpt.GPTConfig()
    model = DDP(gpt.build(cfg, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    chrome = os.path.join(folder, f"rank{rank}.pt.trace.json")
    tb_dir = os.path.join(folder, "tb")
    tb = tensorboard_trace_handler(tb_dir, worker_name=f"rank{rank}")
    ready = []

    def on_trace_ready(prof):   # a trace is saved once: one handler or the other
        if handler == "tensorboard":
            tb(prof)                           # <tb_dir>/rank{r}.<time_ns>.pt.trace.json
        else:
            prof.export_chrome_trace(chrome)   # a file of a fixed name
        ready.append(prof.step_num)

    n = total_steps(wait, warmup, active)
    plan = schedule(wait=wait, warmup=warmup, active=active)
    with profile(activities=[ProfilerActivity.CPU], schedule=plan, on_trace_ready=on_trace_ready,
                 record_shapes=True, with_stack=with_stack) as prof:
        for step in range(n):
            x, y = gpt.synthetic_batch(cfg, batch, seed=100 * step + rank)
            with record_function(PHASES[0]):
                loss = model(x, y)
            with record_function(PHASES[1]):
                loss.backward()
            with record_function(PHASES[2]):
                opt.step()
                opt.zero_grad(set_to_none=True)
            prof.step()
    dist.barrier()
    averages = prof.key_averages()
    table = averages.table(sort_by=sort_by, row_limit=row_limit)
    files = sorted(glob.glob(os.path.join(tb_dir, f"rank{rank}.*.pt.trace.json")))
    path = files[-1] if handler == "tensorboard" else chrome
    top = sorted(averages, key=lambda e: -getattr(e, sort_by))[:row_limit]
    rows = [(e.key, e.count, getattr(e, sort_by)) for e in top]   # the table's rows, us
    phases = {e.key: {"count": e.count, "cpu_time_total_us": e.cpu_time_total} for e in averages
              if e.key in PHASES}
    return {"rank": rank, "path": path, "traced_steps": profiler_steps(path), "ready_at": ready,
            "tensorboard_files": files, "table": table, "rows": rows, "phases": phases, "steps_run": n,
            "scheduled": scheduled_active(wait, warmup, active),
            "stack_frames": sum(1 for e in _events(path) if e.get("cat") == "python_function")}


def _read(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _events(path):
    return _read(path)["traceEvents"]


def profiler_steps(path):
    """The step numbers a trace recorded: its ``ProfilerStep#N`` events, in order."""
    return sorted(int(e["name"].split("#")[1]) for e in _events(path)
                  if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep#"))


def merge_traces(paths, out):
    """Several ranks' chrome traces (``.json`` or ``.json.gz``) as one file, one process per rank.

    Each event's pid becomes its rank (``distributedInfo.rank``, else the file's position), thread
    ids are kept, and each process is named "rank r" and sorted by rank, so a viewer lays the ranks
    out one under the other on one time axis. Returns {"path", "ranks", "events"}."""
    merged, ranks = [], []
    for i, path in enumerate(paths):
        raw = _read(path)
        rank = (raw.get("distributedInfo") or {}).get("rank", i)
        ranks.append(rank)
        for e in raw["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") in _PROCESS_META:
                continue   # replaced by the rank's own below
            merged.append(dict(e, pid=rank))
        merged.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        merged.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"two traces claim the same rank: {ranks}")
    opener = gzip.open if out.endswith(".gz") else open
    with opener(out, "wt") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
    return {"path": out, "ranks": ranks, "events": len(merged)}
