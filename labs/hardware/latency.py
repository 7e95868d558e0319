"""Chapter 11: one machine, two latencies. Why the loopback ping-pong and chapter 10's alpha differ.

Each pattern has its own estimator, and `summarize` keeps them apart. The ping-pong's latency is the
fastest one-way time (half a round trip) of the smallest message over many tries; chapter 10's alpha
is the fastest exchange, which is not halved: each rank's timer runs until its own send is done and
the other's message is in. The two differ about twice over on this machine, so they are never pooled.
Per pattern, the median of the same tries (both starts below), with its distribution-free 95 %
interval (`intervals.median_ranks`), is the time under this machine's load. Each try's time is the
slower rank's; for a try started at a barrier that includes the skew of the two ranks leaving it.
Chapter 10 (`labs.collectives.crossover`) also fits a line by relative error over sizes; its
intercept is a fit parameter, an extrapolation to zero bytes, not a latency: it can fall below every
measured try. On a shared 2-core machine the variants can differ several times over, in either
order. `measure` times, in one job of 2 ranks, each ingredient that separates them, interleaved
round-robin (try i of each variant in turn), and `across_jobs` repeats the small-message part in
more jobs to show how far another moment moves each figure:

- the pattern: ping-pong (one-way = round trip / 2, halved in `summarize`) or simultaneous exchange;
- the start: each timing after a barrier (both processes just woken and running), or back to
  back, without a barrier: right after the previous variant's try in the round-robin (a back-to-back
  ping-pong follows one timed after a barrier), so the receiving rank's timer also runs while the
  previous message is in flight, and a message may have to wake a process that went to sleep
  waiting for it;
- the statistic: median (with its quartiles, the spread) or fastest of the repeats;
- the estimate: the time of a small message, or the intercept of a line fitted over sizes by
  chapter 10's `alpha_beta.fit_line` (least squares on relative errors).

A hypothesis for the slow tries, untested here (no run pins a rank to a core or runs on an idle
machine): a process blocked in a receive is woken when its data arrives, and on a machine whose
cores are all busy it may wait for a core, for instance until the running process's time slice
ends at a scheduler tick (1/CONFIG_HZ s). Wake-up preemption (granted at wake time, not at a tick)
and, on a shared VM, the hypervisor's steal time would produce a similar tail. `kernel_tick_s`
reads CONFIG_HZ from /proc/config.gz where the kernel exposes it, and `measure` reports the share of
back-to-back round trips that took at least one tick: a description, which does not separate these
causes.

    python -m labs.hardware.latency --json
"""
import gzip
import statistics
import time

import torch
import torch.distributed as dist

from labs.collectives import alpha_beta
from labs.launcher import launch
from labs.measure import intervals

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
    ping-pong's round trip (`summarize` halves it), an exchange's whole exchange. The variants are
    interleaved, round-robin: try i of each variant in turn, so a slow moment of the machine falls on
    all of them alike. A back-to-back try starts without a barrier, right after this rank finished the
    previous variant's try."""
    out = {}
    variants = [(kind, start) for kind in PATTERNS for start in STARTS]
    for nbytes in sizes:
        mine, theirs = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        calls = {kind: _pattern(kind, rank, mine, theirs) for kind in PATTERNS}
        for call in calls.values():
            call()                                            # warm-up: connections, buffers
        for kind, start in variants:
            out[f"{kind}/{start}/{nbytes}"] = []
        for _ in range(repeats):
            for kind, start in variants:
                if start == "barrier":
                    dist.barrier()
                t0 = time.perf_counter()
                calls[kind]()
                out[f"{kind}/{start}/{nbytes}"].append(time.perf_counter() - t0)
    return out


def median_interval(xs, level=intervals.LEVEL):
    """The median of ``xs`` and its distribution-free interval (order statistics, the sign test's)."""
    k, _ = intervals.median_ranks(len(xs), level)
    t = sorted(xs)
    return statistics.median(t), (t[k - 1], t[len(t) - k])


def summarize(ranks, sizes, repeats):
    """What `measure` reports, from the two ranks' `rank_times`: each try's time is the slower rank's,
    the ping-pong's halved to one way. Per variant the small message's median, quartiles and fastest;
    per pattern (both starts together) the fastest, the variant that gave it and the median with its
    95 % interval; the intercepts of lines fitted over ``sizes``; the share of back-to-back round
    trips of a tick or more."""
    half = {"pingpong": 2, "exchange": 1}
    slowest = {k: [max(a, b) / half[k.split("/")[0]] for a, b in zip(ranks[0][k], ranks[1][k])]
               for k in ranks[0]}
    small = {}
    for kind in PATTERNS:
        for start in STARTS:
            t = slowest[f"{kind}/{start}/{SMALL}"]
            q1, median, q3 = statistics.quantiles(t, n=4, method="inclusive")
            small[f"{kind}/{start}"] = {"median_s": median, "q1_s": q1, "q3_s": q3, "fastest_s": min(t)}
    patterns = {}
    for kind in PATTERNS:
        tries = [(t, f"{kind}/{start}") for start in STARTS for t in slowest[f"{kind}/{start}/{SMALL}"]]
        fastest, source = min(tries)
        median, ci = median_interval([t for t, _ in tries])
        patterns[kind] = {"fastest_s": fastest, "fastest_variant": source, "median_s": median,
                          "median_ci_s": ci, "tries": len(tries)}
    fits = ({f"exchange/barrier/{stat}":
             alpha_beta.fit_line(sizes, [f(slowest[f"exchange/barrier/{n}"]) for n in sizes])["alpha"]
             for stat, f in (("fastest", min), ("median", statistics.median))} if len(sizes) > 1 else {})
    tick = kernel_tick_s()
    trips = [2 * t for t in slowest[f"pingpong/back_to_back/{SMALL}"]]
    pooled = [t for v in small for t in slowest[f"{v}/{SMALL}"]]
    return {"small_bytes": SMALL, "repeats": repeats, "small": small, "alpha_fits": fits, "tick_s": tick,
            "patterns": patterns,
            # the book's latency: the fastest one-way 8-byte ping-pong of the job, either start
            "latency_s": patterns["pingpong"]["fastest_s"],
            "latency_variant": patterns["pingpong"]["fastest_variant"],
            # chapter 10's alpha on this link: the fastest exchange, not halved
            "exchange_s": patterns["exchange"]["fastest_s"],
            "exchange_over_latency": patterns["exchange"]["fastest_s"] / patterns["pingpong"]["fastest_s"],
            # both patterns' tries pooled: two estimators mixed, kept only to show why it is not quoted
            "pooled_median_s": statistics.median(pooled),
            "pingpong_back_to_back_s": slowest[f"pingpong/back_to_back/{SMALL}"],   # every try, one way
            "tries_s": {v: slowest[f"{v}/{SMALL}"] for v in small},                 # every variant's tries
            "trips_of_a_tick_or_more": None if tick is None else sum(t >= tick for t in trips) / len(trips)}


def measure(sizes=FIT_SIZES, repeats=20, timeout=180.0):
    """One job of 2 ranks (`rank_times`), summarized by `summarize`: per pattern the fastest 8-byte
    try and the median with its interval, every variant's median, quartiles and fastest, chapter 10's
    fitted intercepts over ``sizes`` (none for one size) and the share of back-to-back round trips of
    at least one scheduler tick."""
    if SMALL not in sizes:
        raise ValueError(f"the sizes must include the {SMALL}-byte latency message, got {list(sizes)}.")
    if repeats < 4:
        raise ValueError(f"quartiles need at least 4 repeats, got {repeats}.")
    ranks = launch.spawn(rank_times, 2, list(sizes), repeats, timeout=timeout)
    return summarize(ranks, list(sizes), repeats)


def across_jobs(jobs=4, repeats=20, timeout=180.0):
    """``jobs`` more jobs, one after another, each timing every variant interleaved as `measure` does
    (the 8-byte message only, well under a second each): per variant and per pattern the range over
    the jobs of the fastest try and of the median, and the range of the share of back-to-back round
    trips of a tick or more.
    One job's figures say what that moment cost; the ranges say how far another moment moves them."""
    runs = [measure(sizes=(SMALL,), repeats=repeats, timeout=timeout) for _ in range(jobs)]
    span = lambda xs: (min(xs), max(xs))
    out = {v: {stat: span([r["small"][v][f"{stat}_s"] for r in runs]) for stat in ("fastest", "median")}
           for v in runs[0]["small"]}
    shares = [r["trips_of_a_tick_or_more"] for r in runs]
    return {"jobs": jobs, "small": out, "tick_share": None if None in shares else span(shares),
            "patterns": {k: {stat: span([r["patterns"][k][f"{stat}_s"] for r in runs])
                             for stat in ("fastest", "median")} for k in PATTERNS},
            "exchange_over_latency": span([r["exchange_over_latency"] for r in runs])}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("One machine, two latencies: a loopback ping-pong and chapter 10's fitted alpha, "
                   "taken apart ingredient by ingredient.", world_size_default=2)
    p.add_argument("--repeats", type=cli.positive_int, default=20)
    args = cli.parse(p, argv)
    if args.world_size != 2:
        raise ValueError(f"the measurement uses exactly 2 ranks, got --world-size {args.world_size}; "
                         "drop --world-size.")
    r = measure(repeats=args.repeats, timeout=args.timeout)
    lines = [f"{k:24s} median {v['median_s'] * 1e6:8.0f} us (quartiles {v['q1_s'] * 1e6:.0f} to "
             f"{v['q3_s'] * 1e6:.0f}), fastest {v['fastest_s'] * 1e6:8.0f} us" for k, v in r["small"].items()]
    lines += [f"{k:9s} fastest {v['fastest_s'] * 1e6:.0f} us ({v['fastest_variant']}), median "
              f"{v['median_s'] * 1e6:.0f} us (95 % interval {v['median_ci_s'][0] * 1e6:.0f} to "
              f"{v['median_ci_s'][1] * 1e6:.0f})" for k, v in r["patterns"].items()]
    lines += [f"intercept, {k:24s} {v * 1e6:8.0f} us" for k, v in r["alpha_fits"].items()]
    lines.append(f"scheduler tick {r['tick_s']} s; back-to-back round trips of a tick or more: "
                 f"{r['trips_of_a_tick_or_more']}")
    cli.report(r, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
