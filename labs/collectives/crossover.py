"""Chapter 10: recursive doubling against the ring, timed on both sides of the predicted crossover.

`alpha_beta.crossover` predicts, from fitted alpha and beta, the size n* below which recursive
doubling's all-reduce (few rounds, n bytes each) beats the ring's (2(p-1) rounds of n/p bytes).
A prediction is not a measurement, so `sweep` times both hand all-reduces of
`labs.collectives.algorithms` on p ranks, at sizes from n*/4 to 4 n*, and reports where the
measured times cross beside where the model says they should.

In every round of both algorithms all ranks exchange at once, so alpha and beta are fitted here, in
the same job, on the same p ranks: rank r swaps n bytes with r XOR 1, every pair at once. Each time
is the slowest rank's (a collective ends when its last rank does): a collective's time at a size is
the median of repeats, each after a barrier, the two algorithms taking turns; the fit's exchanges
are the fastest of repeats (as `alpha_beta.fit` does). Timings vary with the machine and its load: the notebook prints them and asserts nothing
about them.

    python -m labs.collectives.crossover --world-size 4 --json
"""
import math
import statistics
import time

import torch
import torch.distributed as dist

from labs.collectives import algorithms, alpha_beta
from labs.collectives.recursive import Rounds
from labs.launcher import launch

FACTORS = (1 / 4, 1 / 2, 1, 2, 4)   # sizes swept, as multiples of the predicted n*
ALGORITHMS = ("ring", "recursive_doubling")


def _slowest(seconds):
    """Per repeat, the slowest rank's seconds (a tensor all-reduced with MAX)."""
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _timed(call, repeats):
    """This rank's seconds for each of ``repeats`` calls, each after a barrier, after one warm-up."""
    call()
    out = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


def _fit(rank, sizes, repeats):
    """alpha, beta by least squares from exchanges with rank XOR 1, all pairs at once."""
    fastest = []
    for nbytes in sizes:
        mine = torch.ones(nbytes // 4, device=launch.device())
        theirs = torch.empty_like(mine)
        exchange = lambda: Rounds().exchange(sends=[(mine, rank ^ 1)], recvs=[(theirs, rank ^ 1)])
        fastest.append(min(_timed(exchange, repeats)))
    fastest = _slowest(fastest)
    a = torch.tensor([[1.0, float(n)] for n in sizes], dtype=torch.float64)   # (sizes, 2)
    alpha, beta = torch.linalg.lstsq(a, torch.tensor(fastest, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    return alpha, beta, fastest


def sweep_sizes(n_star, p, factors=FACTORS):
    """Byte sizes around n*, each a multiple of 4p (fp32 elements in p equal blocks), at least 4p."""
    step = 4 * p
    return sorted({max(step, round(n_star * f / step) * step) for f in factors})


def rank_sweep(rank, world_size, fit_sizes, factors, repeats):
    """One rank: fit alpha and beta, predict n*, time both all-reduces around it.

    At each size the two algorithms take turns, repeat by repeat, so a burst of load on the
    machine falls on both; each time is the slowest rank's, and a size's time the median."""
    alpha, beta, fit_seconds = _fit(rank, fit_sizes, repeats)
    n_star = alpha_beta.crossover(alpha, beta, world_size)
    sizes = sweep_sizes(n_star, world_size, factors) if n_star else list(fit_sizes)
    times, exact = {a: [] for a in ALGORITHMS}, True
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=launch.device())
        per_repeat = {a: [] for a in ALGORITHMS}
        for repeat in range(repeats + 1):                    # repeat 0: warm-up, not kept
            for name in ALGORITHMS:
                x.fill_(1.0)
                dist.barrier()
                start = time.perf_counter()
                algorithms.HAND["all_reduce", name](x, Rounds())
                seconds = time.perf_counter() - start
                exact = exact and bool((x == world_size).all())   # p ones summed: exactly p in fp32
                if repeat:
                    per_repeat[name].append(seconds)
        for name in ALGORITHMS:
            times[name].append(statistics.median(_slowest(per_repeat[name])))
    ok = torch.tensor([int(exact)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)                # every rank's results
    return {"alpha": alpha, "beta": beta, "fit_sizes": list(fit_sizes), "fit_seconds": fit_seconds,
            "predicted": n_star, "sizes": sizes, "seconds": times, "exact": bool(ok.item())}


def measured_crossover(sizes, ring, doubling):
    """The size where doubling stops being faster for good, interpolated in log size between the two
    sizes around it; ("below", sizes[0]) or ("above", sizes[-1]) if the sweep does not bracket it."""
    ratio = [d / r for d, r in zip(doubling, ring)]
    k = next((i for i in range(len(ratio)) if all(x > 1 for x in ratio[i:])), None)
    if k is None:
        return "above", sizes[-1]
    if k == 0:
        return "below", sizes[0]
    lo, hi = math.log(sizes[k - 1]), math.log(sizes[k])
    frac = (1 - ratio[k - 1]) / (ratio[k] - ratio[k - 1])
    return "at", math.exp(lo + frac * (hi - lo))


def sweep(world_size, fit_sizes=alpha_beta.FIT_SIZES, factors=FACTORS, repeats=7, timeout=300.0):
    """Fit, predict and time on ``world_size`` ranks; the predicted and the measured crossover.

    Returns alpha, beta (isolated exchanges), predicted (n* in bytes, None for p = 2), sizes, seconds
    per algorithm (slowest rank, median), exact (every result right), measured: (where, bytes) from
    `measured_crossover`, and seconds_per_round_smallest: each algorithm's time at the smallest size
    over its rounds, the latency a round paid inside a chain of rounds."""
    if world_size < 2 or world_size % 2:
        raise ValueError(f"the sweep pairs rank r with r XOR 1 to fit alpha and beta: use an even world "
                         f"size of at least 2, not {world_size}.")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    r = launch.spawn(rank_sweep, world_size, list(fit_sizes), list(factors), repeats, timeout=timeout)[0]
    where, nbytes = measured_crossover(r["sizes"], r["seconds"]["ring"], r["seconds"]["recursive_doubling"])
    # at the smallest size the bytes cost little: its time over its rounds is what one round cost
    per_round = {a: r["seconds"][a][0] / alpha_beta.costs(world_size)[a][0] for a in ALGORITHMS}
    return {"world_size": world_size, **r, "measured": {"where": where, "bytes": nbytes},
            "seconds_per_round_smallest": per_round}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Recursive doubling against the ring: the predicted crossover (fitted alpha, beta) "
                   "and the measured one (both all-reduces timed around it).", world_size_default=4)
    p.add_argument("--repeats", type=cli.positive_int, default=7)
    args = cli.parse(p, argv)
    r = sweep(args.world_size, repeats=args.repeats, timeout=args.timeout)
    lines = [f"alpha {r['alpha'] * 1e6:.1f} us, 1/beta {1 / r['beta'] / 1e9:.2f} GB/s on {args.world_size} ranks; "
             f"predicted crossover {r['predicted'] and round(r['predicted'] / 1024)} KiB; measured: "
             f"{r['measured']['where']} {r['measured']['bytes'] / 1024:.0f} KiB"]
    lines += [f"{n:>10} B  ring {t1 * 1e3:8.2f} ms  doubling {t2 * 1e3:8.2f} ms"
              for n, t1, t2 in zip(r["sizes"], r["seconds"]["ring"], r["seconds"]["recursive_doubling"])]
    cli.report(r, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
