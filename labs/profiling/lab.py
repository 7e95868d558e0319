"""Chapter 15: any training lab of the book under torch.profiler, one trace per rank, and where each
rank's step time went.

    python -m labs.profiling --lab ddp --world-size 2 --json
    python -m labs.profiling --lab 1f1b --world-size 2 --out traces/ --json

Every rank builds its part of the lab (`labs.profiling.targets`), runs ``warmup`` steps unrecorded
(the first steps pay for connections and allocations), then ``steps`` steps under `trace.Recorder`,
each preceded by a barrier so the ranks start it together. The traces are analysed together
(`labs.profiling.analysis`: the peer waits need every rank's trace) into, per rank, the seconds of
compute, communication in flight, exposed communication, peer wait and idle over the steps, the
overlap fraction, the communication per operation (calls, seconds in flight, bytes the spans
record), and the peak of the profiler's memory record. ``coverage``: the trace's step windows
against the steps' wall-clock times, measured around the same blocks.
"""
import os
import tempfile

import torch.distributed as dist

from labs.launcher import launch
from labs.profiling import analysis, targets, trace


def record(rank, world_size, lab, folder, steps=3, warmup=2, options=None, memory=True):
    """On one rank: build ``lab``, warm up, record ``steps`` steps; returns the trace, read back."""
    step = targets.build(lab, rank, world_size, **(options or {}))
    for _ in range(warmup):
        step()
    with trace.Recorder(folder, rank, memory=memory) as rec:
        for i in range(steps):
            dist.barrier()
            with rec.step(i):
                step()
    dist.barrier()
    return {"rank": rank, "path": rec.path, "wall_s": rec.steps, "threads": rec.threads,
            "trace": trace.load(rec.path)}


def record_many(rank, world_size, runs, steps=3, warmup=2):
    """On one rank: `record` for each (lab, folder, options, memory) of ``runs`` in turn."""
    return [record(rank, world_size, which, folder, steps, warmup, options, memory)
            for which, folder, options, memory in runs]


def summarize(results, skip=0):
    """Per rank: the terms of `analysis.totals` over the recorded steps, per-step rows, the
    communication per operation, the profiler's memory peak, the steps' wall-clock times and the
    trace itself; ``per_rank``: `analysis.analyze`'s rows, intervals included (for `figures`)."""
    traces = [r["trace"] for r in results]
    per_rank = analysis.analyze(traces)
    ranks = []
    for r, rows, t in zip(results, per_rank, traces):
        mem = analysis.memory_timeline(t)
        window = sum(row["step_s"] for row in rows[skip:])
        ranks.append({"rank": r["rank"], "path": r["path"], "trace": t, "totals": analysis.totals(rows, skip),
                      "steps": [{k: v for k, v in row.items() if k != "intervals"} for row in rows],
                      "comm_by_op": analysis.comm_by_op(t),
                      "memory_peak_bytes": max((b for _, b in mem), default=None),
                      "wall_s": r["wall_s"], "wall_total_s": sum(r["wall_s"][skip:]),
                      "trace_total_s": window,
                      "coverage": [analysis.coverage(row, w, th)
                                   for row, w, th in zip(rows, r["wall_s"], r["threads"])]})
    return {"ranks": ranks, "world_size": len(results), "backend": traces[0]["backend"], "per_rank": per_rank}


def run(lab, world_size, steps=3, warmup=2, folder=None, timeout=300, memory=True, **options):
    """Check the input, spawn the ranks (or join torchrun's), analyse every rank's trace.
    ``memory``: record the profiler's memory events too (larger traces)."""
    targets.check(lab, world_size, options.get("microbatches", 4))
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}.")
    folder = folder or os.path.join(tempfile.gettempdir(), "labs-profiles", lab)
    results = launch.launch(record, world_size, lab, os.path.abspath(folder), steps, warmup, options, memory,
                            timeout=timeout, backend=targets.BACKEND.get(lab))
    if results is None:
        return None
    return dict(summarize(results), lab=lab, folder=os.path.abspath(folder),
                oversubscribed=world_size > (os.cpu_count() or 1) and launch.device().type == "cpu")


def run_many(runs, world_size, folder=None, steps=1, warmup=2, timeout=600, memory=("ddp",)):
    """Several labs in one job per backend: ``runs`` is {name: (lab, options)}; the traces of each go
    to ``folder``/<name> (default: a fresh temporary folder). Starting the ranks once for all of them
    saves a job start per lab. ``memory``: the names recorded with memory events. Returns {name:
    `run`'s result}."""
    for which, options in runs.values():
        targets.check(which, world_size, options.get("microbatches", 4))
    folder = os.path.abspath(folder or tempfile.mkdtemp(prefix="labs-profiles-"))
    by_backend = {}
    gpu = launch.device().type == "cuda"
    for name, (which, options) in runs.items():   # on a CPU every lab runs on gloo: one job for all
        by_backend.setdefault(targets.BACKEND.get(which) if gpu else "gloo", []).append(name)
    out = {}
    over = world_size > (os.cpu_count() or 1) and launch.device().type == "cpu"
    for backend, names in by_backend.items():
        jobs = [(runs[n][0], os.path.join(folder, n), runs[n][1], n in memory) for n in names]
        results = launch.launch(record_many, world_size, jobs, steps, warmup, timeout=timeout,
                                backend=backend)
        if results is None:          # a torchrun rank other than 0
            return None
        for i, n in enumerate(names):
            out[n] = dict(summarize([r[i] for r in results]), lab=runs[n][0],
                          folder=os.path.join(folder, n), oversubscribed=over)
    return out


def longer_timeout(parser, seconds):
    """A profiled run takes longer than most labs: a larger default --timeout, and its help says so."""
    for action in parser._actions:
        if action.dest == "timeout":
            action.default = float(seconds)
            action.help = action.help.replace("default 120", f"default {seconds}")


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Profile one of the book's training labs with torch.profiler: one Chrome/Perfetto trace "
                   "per rank, and where each rank's step time went (compute, communication, waiting, idle).")
    p.add_argument("--lab", choices=targets.LABS, required=True)
    p.add_argument("--steps", type=cli.at_most(20, "recorded steps"), default=3)
    p.add_argument("--warmup", type=cli.at_most(20, "unrecorded warm-up steps"), default=2)
    p.add_argument("--microbatches", type=cli.at_most(64, "micro-batches per step"), default=4,
                   help="pipeline labs: micro-batches per step (default 4)")
    p.add_argument("--prefetch", action="store_true", help="fsdp2: issue each all-gather one unit ahead")
    p.add_argument("--no-overlap", action="store_true", help="hand-ddp: all-reduce only after backward")
    p.add_argument("--out", default=None, help="folder for the traces (default: a folder under the temp dir)")
    longer_timeout(p, 300)
    args = cli.parse(p, argv)
    if args.prefetch and args.lab != "fsdp2" or args.no_overlap and args.lab != "hand-ddp":
        raise ValueError("--prefetch applies to --lab fsdp2 only, --no-overlap to --lab hand-ddp only.")
    extra = {"prefetch": True} if args.prefetch else {"overlap": False} if args.no_overlap else {}
    r = run(args.lab, args.world_size, args.steps, args.warmup, args.out, args.timeout,
            microbatches=args.microbatches, **extra)
    if r is None:
        return
    r["per_rank"] = None                     # intervals and events stay out of the printed result
    for rk in r["ranks"]:
        rk.pop("trace")
    lines = [f"{args.lab} on {r['world_size']} ranks, {args.steps} steps; traces in {r['folder']}"
             + (" (more ranks than cores: times are not a timing claim)" if r["oversubscribed"] else "")]
    for rk in r["ranks"]:
        t = rk["totals"]
        lines.append(f"rank {rk['rank']}: step {t['step_s'] * 1e3:.1f} ms = "
                     f"compute {t['compute_s'] * 1e3:.1f} + exposed comm {t['exposed_comm_s'] * 1e3:.1f} + "
                     f"peer wait {t['peer_wait_s'] * 1e3:.1f} + input {t['input_s'] * 1e3:.1f} + "
                     f"idle {t['idle_s'] * 1e3:.1f}; comm in flight {t['comm_s'] * 1e3:.1f} ms, overlap "
                     + ("-" if t["overlap_fraction"] is None else f"{t['overlap_fraction']:.2f}"))
    cli.report(r, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
