"""Chapter 10: recursive doubling against the ring, timed on both sides of the predicted crossover.

`alpha_beta.crossover` predicts, from fitted alpha and beta, the size M* below which recursive
doubling's all-reduce (few rounds, M bytes each) beats the ring's (2(N-1) rounds of M/N bytes).
A prediction is not a measurement, so `sweep` times both hand all-reduces of
`labs.collectives.algorithms` on N ranks, at sizes from M*/4 to 4 M*, and reports where the
measured times cross beside where the model says they should.

In every round of both algorithms all ranks exchange at once, so alpha and beta are fitted here, in
the same job, on the same N ranks: rank r swaps M bytes with r XOR 1, every pair at once. alpha is
the latency, the fastest try at the smallest size; beta is fitted by relative error through the
fastest try per size with alpha held fixed (`alpha_beta.model`); a line with a free intercept is
returned beside it, its intercept a fit parameter, not a latency.
Each time is the slowest rank's (a collective ends when its last rank does). At each size the
two all-reduces take turns, repeat by repeat, the first of the pair alternating, so each repeat
gives one paired ratio
doubling / ring; `labs.measure.intervals` turns the ratios into a median with its interval and
range, and names the faster algorithm only where the interval excludes 1 and no more ranks ran
than the machine has cores. On a GPU the clock is read after `torch.cuda.synchronize`.

    python -m labs.collectives.crossover --world-size 4 --json
"""
import statistics

import torch
import torch.distributed as dist

from labs.collectives import algorithms, alpha_beta
from labs.collectives.recursive import Rounds
from labs.launcher import launch
from labs.measure import intervals, timing

FACTORS = (1 / 4, 1 / 2, 1, 2, 4)   # sizes swept, as multiples of the predicted M*
ALGORITHMS = ("ring", "recursive_doubling")
REPEATS = 15                        # paired repeats per size: a 96.5 % interval from order statistics


def _slowest(seconds):
    """Per repeat, the slowest rank's seconds (a tensor all-reduced with MAX)."""
    t = torch.tensor(seconds, dtype=torch.float64, device=launch.device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _seconds(call):
    """This rank's seconds for one call, started after a barrier with the GPU idle (`timing.now`)."""
    dist.barrier()
    start = timing.now()
    call()
    return timing.now() - start


def _exchange_times(rank, sizes, repeats):
    """Per size, the slowest rank's seconds of each repeat of one exchange with rank XOR 1. The
    sizes are interleaved, swept up and then down in turn, so a slow moment of the machine falls on
    all sizes alike, and every try, the first included, follows a try of the same or a neighbouring
    size (the warm-up sweeps down, ending at the smallest): a tiny exchange timed right after the
    largest one can be slow on a loaded machine."""
    dev = launch.device()
    bufs = [(torch.ones(n // 4, device=dev), torch.empty(n // 4, device=dev)) for n in sizes]
    calls = [lambda m=m, t=t: Rounds().exchange(sends=[(m, rank ^ 1)], recvs=[(t, rank ^ 1)])
             for m, t in bufs]
    for call in reversed(calls):                 # warm-up, largest first: repeat 0 starts where it ends
        call()
    seconds = [[] for _ in sizes]
    for repeat in range(repeats):
        for i in (range(len(sizes)) if repeat % 2 == 0 else reversed(range(len(sizes)))):
            seconds[i].append(_seconds(calls[i]))
    return [_slowest(t) for t in seconds]


def sweep_sizes(m_star, n, factors=FACTORS):
    """Byte sizes around M*, each a multiple of 4N (fp32 elements in N equal blocks), at least 4N."""
    step = 4 * n
    return sorted({max(step, round(m_star * f / step) * step) for f in factors})


def rank_sweep(rank, world_size, fit_sizes, factors, repeats):
    """One rank: fit alpha and beta, predict M*, time both all-reduces around it, in pairs."""
    fit_times = _exchange_times(rank, fit_sizes, repeats)
    fastest = [min(t) for t in fit_times]
    used = alpha_beta.model(fit_sizes, fit_times)   # alpha: the latency; the intercept: a fit parameter
    m_star = alpha_beta.crossover(used["alpha"], used["beta"], world_size)
    step = 4 * world_size                                 # fp32 elements in N equal blocks
    sizes = (sweep_sizes(m_star, world_size, factors) if m_star      # no M* (N = 2): the fit's sizes
             else sorted({-(-n // step) * step for n in fit_sizes}))
    times, exact = {a: [] for a in ALGORITHMS}, True
    for nbytes in sizes:
        # distinct small integers per element and rank, so a block sent or added in the wrong place
        # shows; every partial sum stays below 2^24, so any order of the additions is exact in fp32
        index = torch.arange(nbytes // 4, device=launch.device()) % 1024
        start = (index + 1024 * rank).float()
        expected = (world_size * index + 1024 * world_size * (world_size - 1) // 2).float()
        x = start.clone()
        per_repeat = {a: [] for a in ALGORITHMS}
        for repeat in range(repeats + 1):                    # repeat 0: warm-up, not kept
            for name in (ALGORITHMS if repeat % 2 else ALGORITHMS[::-1]):   # who goes first alternates
                x.copy_(start)
                seconds = _seconds(lambda: algorithms.HAND["all_reduce", name](x, Rounds()))
                exact = exact and torch.equal(x, expected)
                if repeat:
                    per_repeat[name].append(seconds)
        for name in ALGORITHMS:
            times[name].append(_slowest(per_repeat[name]))
    ok = torch.tensor([int(exact)], device=launch.device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)                # every rank's results
    return {"alpha": used["alpha"], "beta": used["beta"], "fit_sizes": list(fit_sizes),
            "fit_seconds": fastest, "fit_residuals": used["residuals"], "fit_times": fit_times,
            "intercept": used["intercept"], "line_beta": used["line_beta"],
            "line_residuals": used["line_residuals"],
            "fit_median_seconds": [statistics.median(t) for t in fit_times],
            "predicted": m_star, "sizes": sizes, "seconds": times, "exact": bool(ok.item())}


def measured_crossover(sizes, verdicts):
    """Where the faster algorithm changes, from the sizes whose verdict is resolved.

    ("between", (a, b)): doubling faster at a, the ring at b, every resolved doubling size below
    every resolved ring size; ("above", a) or ("below", b) when only one side was resolved;
    ("unresolved", None) when none was, or when the resolved sizes contradict one another."""
    doubling = [s for s, v in zip(sizes, verdicts) if v == "recursive_doubling"]
    ring = [s for s, v in zip(sizes, verdicts) if v == "ring"]
    if doubling and ring:
        return ("between", (max(doubling), min(ring))) if max(doubling) < min(ring) else ("unresolved", None)
    if doubling:
        return "above", max(doubling)
    if ring:
        return "below", min(ring)
    return "unresolved", None


def describe(where, at):
    """The measured crossover in words, sizes in KiB."""
    kib = lambda n: f"{n / 1024:.0f} KiB"
    return {"between": lambda: f"between {kib(at[0])} and {kib(at[1])}",
            "above": lambda: f"above {kib(at)}", "below": lambda: f"below {kib(at)}",
            "unresolved": lambda: intervals.UNRESOLVED}[where]()


def sweep(world_size, fit_sizes=alpha_beta.FIT_SIZES, factors=FACTORS, repeats=REPEATS, timeout=300.0):
    """Fit, predict and time on ``world_size`` ranks; the predicted and the measured crossover.

    Returns alpha (the latency: fastest smallest-size try), beta (fitted with alpha fixed),
    fit_residuals (relative, of alpha + n beta), fit_times (every try), intercept and
    line_beta, line_residuals (the free line's: fit parameters and its residuals), fit_median_seconds,
    predicted (M* in bytes, None for N = 2), sizes, seconds (per algorithm and size, the slowest
    rank's time of each repeat),
    ratios (per size, `intervals.ratio_interval` of doubling / ring, with its verdict), cores,
    measured (where, bytes, text) and seconds_per_round_smallest with model_round_smallest: at the
    smallest size, each algorithm's median time over its rounds beside alpha + (bytes a round
    moves) beta, what the fit says a round costs."""
    if world_size < 2 or world_size % 2:
        raise ValueError(f"the sweep pairs rank r with r XOR 1 to fit alpha and beta: use an even world "
                         f"size of at least 2, not {world_size}.")
    intervals.median_ranks(repeats)                          # refuses too few repeats before spawning
    r = launch.spawn(rank_sweep, world_size, list(fit_sizes), list(factors), repeats, timeout=timeout)[0]
    cores = intervals.cores()
    ratios = []
    for ring, doubling in zip(r["seconds"]["ring"], r["seconds"]["recursive_doubling"]):
        iv = intervals.ratio_interval(doubling, ring)
        iv["verdict"] = intervals.verdict(iv, "recursive_doubling", "ring", world_size, cores)
        ratios.append(iv)
    where, at = measured_crossover(r["sizes"], [iv["verdict"] for iv in ratios])
    costs, smallest = alpha_beta.costs(world_size), r["sizes"][0]
    per_round = {a: statistics.median(r["seconds"][a][0]) / costs[a][0] for a in ALGORITHMS}
    # a round moves (bytes along the critical path) / rounds: M/N for the ring, M for doubling
    model = {a: r["alpha"] + costs[a][1] / costs[a][0] * smallest * r["beta"] for a in ALGORITHMS}
    return {"world_size": world_size, "cores": cores, "repeats": repeats, **r, "ratios": ratios,
            "measured": {"where": where, "bytes": at, "text": describe(where, at)},
            "seconds_per_round_smallest": per_round, "model_round_smallest": model}


def table(result):
    """One line per size: both medians, the ratio doubling / ring, its interval, its range, verdict."""
    lines = [f"{'size KiB':>9} {'ring ms':>8} {'dbl ms':>8} {'dbl/ring':>8} "
             f"{'interval':>14} {'range':>14}  faster"]
    for n, ring, dbl, iv in zip(result["sizes"], result["seconds"]["ring"],
                                result["seconds"]["recursive_doubling"], result["ratios"]):
        med = lambda t: statistics.median(t) * 1e3
        faster = {"recursive_doubling": "doubling"}.get(iv["verdict"], iv["verdict"])
        faster = "not resolved" if faster == intervals.UNRESOLVED else faster
        lines.append(f"{n / 1024:>9.1f} {med(ring):>8.2f} {med(dbl):>8.2f} {iv['median']:>8.2f} "
                     f"[{iv['low']:5.2f}, {iv['high']:5.2f}] "
                     f"[{iv['lowest']:5.2f}, {iv['highest']:5.2f}]  {faster}")
    return "\n".join(lines)


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Recursive doubling against the ring: the predicted crossover (fitted alpha, beta) "
                   "and the measured one (both all-reduces timed around it, in pairs).", world_size_default=4)
    p.add_argument("--repeats", type=cli.positive_int, default=REPEATS)
    args = cli.parse(p, argv)
    r = sweep(args.world_size, repeats=args.repeats, timeout=args.timeout)
    predicted = f"{r['predicted'] / 1024:.0f} KiB" if r["predicted"] else "none (doubling wins at every size)"
    bandwidth = f"{1 / r['beta'] / 1e9:.2f} GB/s" if r["beta"] > 0 else f"beta = {r['beta']:.3g} s/B"
    lines = [f"alpha {r['alpha'] * 1e6:.1f} us, 1/beta {bandwidth} on {args.world_size} ranks "
             f"({r['cores']} cores); predicted crossover {predicted}; measured: {r['measured']['text']}",
             table(r)]
    cli.report(r, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
