"""Chapter 15: the traces the chapter page links, recorded on purpose, once, by one command.

    python -m labs.profiling.recorded --out notebooks/traces/15

One step of each lab of `RUNS` on 2 ranks after two unrecorded warm-up steps (DDP rebuilds its buckets
after the first step and broadcasts their layout in the second), written to
``--out``/<name>/rank<r>.json.gz (gzipped Chrome JSON; open it in chrome://tracing or Perfetto, whose
versions before mid-2026 drop the point-to-point spans that overlap the thread's operators). The
notebook runs the same labs into a temporary folder and only reads these files, so executing it never
rewrites a committed trace.
"""
import os

from labs.profiling import lab

# name: (lab, options); the traces the chapter links, and the labs notebook 15 profiles
RUNS = {"ddp": ("ddp", {}), "hand-fsdp": ("fsdp", {}), "fsdp2": ("fsdp2", {}),
        "fsdp2-prefetch": ("fsdp2", {"prefetch": True}), "tp": ("tp", {}),
        "gpipe": ("gpipe", {}), "1f1b": ("1f1b", {})}
MEMORY = ("ddp",)          # recorded with the profiler's memory events too
LARGEST = 2**20            # bytes: a linked trace stays small enough to commit


def record(out, world_size=2, timeout=600):
    """`RUNS` into ``out``; refuses a trace over `LARGEST` bytes. Returns {name: `lab.run`'s result}."""
    runs = lab.run_many(RUNS, world_size, out, steps=1, warmup=2, timeout=timeout, memory=MEMORY)
    for name, r in (runs or {}).items():
        for rk in r["ranks"]:
            if os.path.getsize(rk["path"]) > LARGEST:
                raise ValueError(f"{rk['path']} is over {LARGEST} bytes: too large to commit.")
    return runs


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Record the traces chapter 15 links: one profiled step of each lab, one trace per rank.")
    p.add_argument("--out", required=True, help="folder for the traces, e.g. notebooks/traces/15")
    lab.longer_timeout(p, 600)
    args = cli.parse(p, argv)
    runs = record(args.out, args.world_size, args.timeout)
    if runs is None:
        return
    result = {name: [rk["path"] for rk in r["ranks"]] for name, r in runs.items()}
    cli.report(result, args, "\n".join(f"{n}: {', '.join(paths)}" for n, paths in result.items()))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
