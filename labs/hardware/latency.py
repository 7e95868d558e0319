"""Chapter 11: the loopback's latency, chapter 10's alpha, and a one-way ping-pong beside it.

Each pattern has its own estimator, and `summarize` keeps them apart. The book's latency alpha
(chapter 10's definition) is the fastest of many exchanges of the smallest message started after a
barrier: whatever else the machine does can only add to a try, so among tries started alike the
fastest is least disturbed (which start gives the faster try is not shown to hold from job to job).
An exchange is not halved: each rank's timer runs until its own send is done and the other's
message is in. Beside it, the fastest one-way time (half a round trip) of a ping-pong started after
a barrier, what one message one way cost. The two differ (by a ratio that moves from job to job on
this machine), so they are never pooled, and neither are the two starts below: a back-to-back try
measures the link plus the wake-up of a receiver that went to sleep and whatever the previous try
left in flight. Per variant, the median of the same tries (with its quartiles) is the time under
this machine's load; it moves from job to job, which `across_jobs` shows. Each try's time is the
slower rank's; for a try started at a barrier that includes the skew of the two ranks leaving it.
Chapter 10 (`labs.collectives.crossover`) also fits a line by relative error over sizes; its
intercept is a fit parameter, an extrapolation to zero bytes, not a latency: it can fall below every
measured try. `measure` times, in one job of 2 ranks, each ingredient that separates the numbers,
the sizes and the variants interleaved round-robin (try i of each variant at each size in turn, each
round starting one size further along):

- the pattern: ping-pong (one-way = round trip / 2, halved in `summarize`) or simultaneous exchange;
- the start: each timing after a barrier (both ranks leave it together; a receiver still sleeps in
  gloo's receive until its message arrives), or back to back, without a barrier: right after the
  previous variant's try in the round-robin (a back-to-back ping-pong follows one timed after a
  barrier), so the receiving rank's timer also runs while the previous message is in flight;
- the statistic: median (with its quartiles, the spread) or fastest of the repeats;
- the estimate: the time of a small message, or the intercept of a line fitted over sizes by
  chapter 10's `alpha_beta.fit_line` (least squares on relative errors).

A hypothesis for the slow tries, untested here (no run pins a rank to a core or runs on an idle
machine): a process blocked in a receive is woken when its data arrives, and on a machine whose
cores are all busy it may wait for a core, for instance until the running process's time slice
ends at a scheduler tick (1/CONFIG_HZ s). Wake-up preemption (granted at wake time, not at a tick)
and, on a shared VM, the hypervisor's steal time would produce a similar tail. `kernel_tick_s`
reads CONFIG_HZ from /proc/config.gz where the kernel exposes it, and `summarize` reports, per
variant, the share of whole tries (a ping-pong's round trip, not its one-way time; an exchange)
that took at least a quarter of a tick: a wait for the next tick lasts anywhere from 0 to a whole
tick, so a threshold of one tick would miss nearly all such waits, while a quarter keeps at least
three in four of them (the threshold applies to the whole try, wait included). A description,
which does not separate these causes.

    python -m labs.hardware.latency --json
"""
import gzip
import statistics
import time

import torch
import torch.distributed as dist

from labs.collectives import alpha_beta
from labs.launcher import launch

SMALL = 8                                              # bytes: the latency message
PATTERNS, STARTS = ("pingpong", "exchange"), ("barrier", "back_to_back")
FIT_SIZES = (8, 1024, 16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024)


def kernel_tick_s():
    """1 / CONFIG_HZ from /proc/config.gz, or None where the kernel does not expose its config."""
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            hz = [line.split("=")[1] for line in f if line.startswith("CONFIG_HZ=")]
        return 1 / int(hz[0]) if hz else None
    except OSError:
        return None


def _pattern(kind, rank, mine, theirs):
    peer = 1 - rank
    if kind == "exchange":
        return lambda: [req.wait() for req in (dist.isend(mine, peer), dist.irecv(theirs, peer))]
    first, second = (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)
    return lambda: (first(mine, peer), second(mine, peer))


@launch.on_cpu("the loopback's two latencies: gloo on CPU tensors, timed with the host clock")
def rank_times(rank, world_size, sizes, repeats):
    """One rank: {(pattern, start, size): seconds per repeat}, each try's whole time on this rank: a
    ping-pong's round trip (`summarize` halves it), an exchange's whole exchange. The sizes and the
    variants are interleaved, round-robin: try i of each variant at each size in turn, so a slow moment
    of the machine falls on all of them alike, and round i starts at size i (mod the sizes), so no size
    always follows the largest. A back-to-back try starts without a barrier, right after
    this rank finished the previous variant's try (of the same size, but for the first variant)."""
    out, calls = {}, {}
    variants = [(kind, start) for kind in PATTERNS for start in STARTS]
    for nbytes in sizes:
        mine, theirs = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        calls[nbytes] = {kind: _pattern(kind, rank, mine, theirs) for kind in PATTERNS}
        for call in calls[nbytes].values():
            call()                                            # warm-up: connections, buffers
        for kind, start in variants:
            out[f"{kind}/{start}/{nbytes}"] = []
    for i in range(repeats):
        for nbytes in sizes[i % len(sizes):] + sizes[:i % len(sizes)]:   # rotated: no size always first
            for kind, start in variants:
                if start == "barrier":
                    dist.barrier()
                t0 = time.perf_counter()
                calls[nbytes][kind]()
                out[f"{kind}/{start}/{nbytes}"].append(time.perf_counter() - t0)
    return out


def summarize(ranks, sizes, repeats, tick=None):
    """What `measure` reports, from the two ranks' `rank_times`: each try's time is the slower rank's,
    the ping-pong's halved to one way. Per variant (pattern and start, never pooled) the small
    message's median, quartiles and fastest; the latency alpha, the fastest exchange after a barrier
    (chapter 10's estimator), and its ratio to the fastest one-way ping-pong after a barrier; the
    intercepts of lines fitted over ``sizes``; per variant the share of whole tries (round trips,
    exchanges) of a quarter tick (``tick`` seconds, by default the kernel's) or more."""
    half = {"pingpong": 2, "exchange": 1}
    slowest = {k: [max(a, b) / half[k.split("/")[0]] for a, b in zip(ranks[0][k], ranks[1][k])]
               for k in ranks[0]}
    small = {}
    for kind in PATTERNS:
        for start in STARTS:
            t = slowest[f"{kind}/{start}/{SMALL}"]
            q1, median, q3 = statistics.quantiles(t, n=4, method="inclusive")
            small[f"{kind}/{start}"] = {"median_s": median, "q1_s": q1, "q3_s": q3, "fastest_s": min(t)}
    fits = ({f"exchange/barrier/{stat}":
             alpha_beta.fit_line(sizes, [f(slowest[f"exchange/barrier/{n}"]) for n in sizes])["alpha"]
             for stat, f in (("fastest", min), ("median", statistics.median))} if len(sizes) > 1 else {})
    tick = kernel_tick_s() if tick is None else tick
    whole = {v: [half[v.split("/")[0]] * t for t in slowest[f"{v}/{SMALL}"]] for v in small}
    alpha, one_way = small["exchange/barrier"]["fastest_s"], small["pingpong/barrier"]["fastest_s"]
    return {"small_bytes": SMALL, "repeats": repeats, "small": small, "alpha_fits": fits, "tick_s": tick,
            # the latency alpha (chapter 10's): the fastest 8-byte exchange after a barrier, not halved
            "alpha_s": alpha,
            # beside it: the fastest one-way 8-byte ping-pong after a barrier
            "one_way_s": one_way, "alpha_over_one_way": alpha / one_way,
            "tries_s": {v: slowest[f"{v}/{SMALL}"] for v in small},                 # every variant's tries
            # the fastest exchange after a barrier at each size: a larger one faster than alpha makes
            # alpha an upper bound (chapter 10's check)
            "exchange_fastest_by_size": {n: min(slowest[f"exchange/barrier/{n}"]) for n in sizes},
            # per variant, the share of whole tries (round trips, not one way) of a quarter tick or more
            "quarter_tick_share": None if tick is None else
            {v: sum(4 * t >= tick for t in ts) / len(ts) for v, ts in whole.items()}}


def measure(sizes=FIT_SIZES, repeats=20, timeout=180.0):
    """One job of 2 ranks (`rank_times`), summarized by `summarize`: the latency alpha (the fastest
    8-byte exchange after a barrier), every variant's median, quartiles and fastest, chapter 10's
    fitted intercepts over ``sizes`` (none for one size) and, per variant, the share of whole tries of
    at least a quarter of a scheduler tick."""
    if SMALL not in sizes:
        raise ValueError(f"the sizes must include the {SMALL}-byte latency message, got {list(sizes)}.")
    if repeats < 4:
        raise ValueError(f"quartiles need at least 4 repeats, got {repeats}.")
    ranks = launch.spawn(rank_times, 2, list(sizes), repeats, timeout=timeout)
    return summarize(ranks, list(sizes), repeats)


def across_jobs(jobs=4, repeats=20, timeout=180.0, run=None):
    """``jobs`` more jobs, one after another, each timing every variant at every size interleaved as
    `measure` does (a few seconds each): per variant the range over the jobs of the fastest try, of the
    median and of the share of whole tries of a quarter tick or more, the range of alpha over the
    one-way ping-pong, and per job its alpha, that ratio and whether a larger exchange beat alpha
    (chapter 10's check: then that job's alpha is an upper bound). ``run`` replaces `measure` (the
    tests' made-up jobs). One job's figures say what that moment cost; the ranges say how far another
    moment moves them."""
    run = run or (lambda: measure(repeats=repeats, timeout=timeout))
    runs = [run() for _ in range(jobs)]
    span = lambda xs: (min(xs), max(xs))
    out = {v: {stat: span([r["small"][v][f"{stat}_s"] for r in runs]) for stat in ("fastest", "median")}
           for v in runs[0]["small"]}
    shares = [r["quarter_tick_share"] for r in runs]
    return {"jobs": jobs, "small": out,
            "quarter_tick_share": None if None in shares else {v: span([s[v] for s in shares]) for v in out},
            "alpha_over_one_way": span([r["alpha_over_one_way"] for r in runs]),
            "alpha_s": [r["alpha_s"] for r in runs], "alpha_upper_bound": [upper_bound(r) for r in runs],
            "alpha_over_one_way_each": [r["alpha_over_one_way"] for r in runs]}


def upper_bound(r):
    """Whether a larger exchange after a barrier beat a `summarize` result's alpha (chapter 10's
    check, `alpha_beta.faster_than_alpha`): then alpha is an upper bound on the latency."""
    by_size = r["exchange_fastest_by_size"]
    return bool(alpha_beta.faster_than_alpha(list(by_size), list(by_size.values()), r["alpha_s"]))


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("The loopback's latency alpha (the fastest small exchange), a one-way ping-pong beside "
                   "it and chapter 10's fitted intercept, taken apart ingredient by ingredient.",
                   world_size_default=2)
    p.add_argument("--repeats", type=cli.positive_int, default=20)
    args = cli.parse(p, argv)
    if args.world_size != 2:
        raise ValueError(f"the measurement uses exactly 2 ranks, got --world-size {args.world_size}; "
                         "drop --world-size.")
    r = measure(repeats=args.repeats, timeout=args.timeout)
    lines = [f"{k:24s} median {v['median_s'] * 1e6:8.0f} us (quartiles {v['q1_s'] * 1e6:.0f} to "
             f"{v['q3_s'] * 1e6:.0f}), fastest {v['fastest_s'] * 1e6:8.0f} us" for k, v in r["small"].items()]
    lines.append(f"latency alpha (fastest exchange after a barrier) {r['alpha_s'] * 1e6:.0f} us, "
                 f"{r['alpha_over_one_way']:.1f} times the fastest one-way ping-pong after a barrier")
    lines += [f"intercept, {k:24s} {v * 1e6:8.0f} us" for k, v in r["alpha_fits"].items()]
    lines.append(f"scheduler tick {r['tick_s']} s; whole tries of a quarter tick or more: "
                 f"{r['quarter_tick_share']}")
    cli.report(r, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
