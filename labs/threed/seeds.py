"""Chapter 17: the planted bugs over many runs, recorded once, by hand; the notebook only reads it.

    python -m labs.threed.seeds --seeds 24 --out results/threed/seeds.json

Runs `drift.table` for every variant of `drift.VARIANTS` on the runs of seeds 0, ..., n - 1 (the model
of seed k, the batches shifted by `layout3d.SEED_STRIDE` k) and writes, per seed and variant, the loss
difference over the bound at each step, the first step beyond it and the step-1 gradient check's
verdict, with the torch version, the date, the command and the commit. Two 8-rank jobs and three
one-process bounds per seed, about 16 s a seed on a 2-core machine (the file records the run's
seconds): too long for the tests, so neither they nor the notebook run it. `summary` counts, per
planted bug, the seeds on which it first leaves the bound at each step, and names the runs that fall
back inside after leaving.
"""
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import torch

from labs.threed import drift

# this file is labs/<package>/<file>.py: three levels up is the repository
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "results", "threed", "seeds.json")
KEEP = ("ratio", "diff", "bound", "first_step_beyond", "max_ratio", "grads_pass")


def sweep(seeds, timeout=600, done=None):
    """{seed: {variant: row}} for every variant of `drift.VARIANTS` (a row: `KEEP` of `drift.table`'s),
    one seed at a time; ``done(so_far)`` is called after each seed."""
    out = {}
    for seed in seeds:
        rows = {}
        for layout in (drift.LAYOUT_3D, drift.LAYOUT_CP):
            names = [n for n, v in drift.VARIANTS.items() if v[0] == layout]
            table = drift.table(names, timeout=timeout, seeds=(seed,))
            rows.update({n: {k: r[k] for k in KEEP} for n, r in table["rows"].items()})
        out[seed] = rows
        if done is not None:
            done(out)
    return out


def _commit():
    """The repository's commit, and whether labs/ had uncommitted changes, for the provenance; None
    outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "labs"], capture_output=True,
                               text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (" with uncommitted changes in labs/" if dirty else "")


def record(path, seeds, timeout=600):
    """Run `sweep` and write it to ``path`` (JSON) after every seed, with its provenance."""
    start = time.perf_counter()
    head = {"command": "python -m labs.threed.seeds " + " ".join(sys.argv[1:]),
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads",
            "date": datetime.date.today().isoformat(), "seeds": list(seeds), "commit": _commit()}

    def write(so_far):
        data = {**head, "seconds": round(time.perf_counter() - start), "complete": len(so_far) == len(seeds),
                "by_seed": {str(s): rows for s, rows in so_far.items()}}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")

    return sweep(seeds, timeout, write)


def load(path=RESULTS):
    """The recorded sweep, its seeds as ints."""
    with open(path) as f:
        data = json.load(f)
    data["by_seed"] = {int(s): rows for s, rows in data["by_seed"].items()}
    return data


def summary(by_seed):
    """Per planted bug of `drift.VARIANTS`: "first" {step: how many seeds it first leaves the bound at
    that step}, "never" (seeds it stays inside at every step), "back_inside" [(seed, ratios)] (it left
    the bound and is inside it at a later step), "least_first" (the smallest ratio at a first step
    beyond, and its seed). Plus, over every seed, the largest ratio of the correct layouts and of each
    scale bug (`drift.SCALE_BUGS`)."""
    bugs = [n for n in drift.VARIANTS if drift.is_bug(n)]
    out = {"seeds": len(by_seed), "bugs": {}, "largest": {}}
    for name in drift.VARIANTS:
        rows = {s: by_seed[s][name] for s in sorted(by_seed)}
        out["largest"][name] = max(r["max_ratio"] for r in rows.values())
        if name not in bugs:
            continue
        first, never, back, least = {}, [], [], (float("inf"), None)
        for s, r in rows.items():
            t = r["first_step_beyond"]
            if t is None:
                never.append(s)
                continue
            first[t] = first.get(t, 0) + 1
            least = min(least, (r["ratio"][t - 1], s))
            if any(x <= 1 for x in r["ratio"][t:]):
                back.append((s, r["ratio"]))
        out["bugs"][name] = {"first": dict(sorted(first.items())), "never": never, "back_inside": back,
                             "least_first": least}
    return out


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Record chapter 17's planted bugs over the runs of seeds 0..n-1 (two 8-rank jobs a "
                   "seed).", world_size_default=8)
    p.add_argument("--seeds", type=cli.positive_int, default=24, help="how many seeds, from 0 (default 24)")
    p.add_argument("--out", default=RESULTS, help="the JSON file (default results/threed/seeds.json)")
    p.set_defaults(timeout=600.0)
    args = cli.parse(p, argv)
    if args.world_size != 8:
        raise ValueError(f"both layouts run on 8 ranks, not --world-size {args.world_size}.")
    data = record(args.out, range(args.seeds), args.timeout)
    s = summary(data)
    lines = (f"{n}: first beyond at step {b['first']}, never {b['never']}, back inside on seeds "
             f"{[k for k, _ in b['back_inside']]}" for n, b in s["bugs"].items())
    cli.report(s, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
