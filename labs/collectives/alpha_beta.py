"""Chapter 10: the alpha-beta model fitted on this machine, and an nccl-tests-style table.

Hockney's model, as Thakur, Rabenseifner & Gropp (2005) use it: a message of n bytes
takes alpha + n * beta. `fit_line` estimates alpha and beta from measured times of one exchange per
size (`labs.collectives.crossover` times them on the ranks it sweeps; chapter 11's
`labs.hardware.latency` on 2) by least squares on the relative errors, since the times span three
orders of magnitude and an unweighted fit spends itself on the largest sizes, whose noise alone
exceeds alpha. `costs` gives each all-reduce's rounds and bytes along its critical path
(the tests set them beside the counted ones), and `crossover` the size below which recursive
doubling, L (alpha + n beta), beats the ring, 2(p-1) * alpha + 2(p-1)/p * n * beta:

    n* = (2(p-1) - L) * alpha / ((L - 2(p-1)/p) * beta)

with L = lg p rounds for a power of two, lg p' + 2 otherwise (p' = 2^floor(lg p): the extra ranks
fold in first and unfold last). `labs.collectives.crossover` times both algorithms around n*.

`bench` times the library's collectives and reports algbw and busbw with nccl-tests' definitions
(`labs.data_parallel.bus_bandwidth`), on whatever backend `labs.launcher.launch` chose: gloo here, NCCL on a
GPU box.
"""
import random
import statistics

import torch
import torch.distributed as dist

from labs.data_parallel import bus_bandwidth
from labs.measure import comm, intervals, timing
from labs.launcher import launch, preflight

FIT_SIZES = [4, 1024, 16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024]   # bytes
BENCH_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BENCH_SIZES = [4 * 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024]      # bytes, the full buffer M


def _median_seconds(call, repeats, stat=statistics.median):
    """Median (or ``stat``) of ``repeats`` timed calls, each after a barrier, after one warm-up."""
    call()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = timing.now()                  # after the GPU's queued work, not at its launch
        call()
        times.append(timing.now() - start)
    return stat(times)


def fit_line(sizes, seconds):
    """alpha (s) and beta (s/byte) of t = alpha + n beta, minimising the squared relative errors
    sum(((t_i - alpha - n_i beta) / t_i)^2): weighted least squares with weights 1/t_i.

    Returns alpha, beta, predicted (alpha + n beta per size) and residuals ((t - predicted) / t
    per size). Unweighted, a 1 % error at 4 MiB (a few hundred microseconds here) moves the
    intercept by more than alpha itself; weighted, every size counts by its relative error."""
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError(f"a line needs times at two or more distinct sizes, got sizes {list(sizes)} "
                         f"and {len(seconds)} times.")
    if min(seconds) <= 0:
        raise ValueError(f"times must be positive, got {list(seconds)}.")
    t = torch.tensor(seconds, dtype=torch.float64)                                   # (sizes,)
    a = torch.tensor([[1.0, float(n)] for n in sizes], dtype=torch.float64) / t[:, None]  # (sizes, 2)
    ones = torch.ones(len(sizes), 1, dtype=torch.float64)                              # (sizes, 1)
    alpha, beta = torch.linalg.lstsq(a, ones).solution[:, 0].tolist()
    predicted = [alpha + n * beta for n in sizes]
    return {"alpha": alpha, "beta": beta, "predicted": predicted,
            "residuals": [(s - p) / s for s, p in zip(seconds, predicted)]}


def fit_slope(sizes, seconds, alpha):
    """beta (s/byte) of t = alpha + n beta with alpha fixed (measured, not fitted), minimising the
    same squared relative errors as `fit_line`: one parameter, so a closed form. With
    x_i = n_i / t_i and y_i = (t_i - alpha) / t_i, the residual is y_i - beta x_i, and
    beta = sum(x_i y_i) / sum(x_i^2). Returns beta and residuals ((t - alpha - n beta) / t)."""
    if len(sizes) != len(seconds) or not any(sizes) or min(seconds) <= 0:
        raise ValueError(f"a slope needs positive times and a size above 0 bytes, got sizes {list(sizes)} "
                         f"and times {list(seconds)}.")
    x = [n / t for n, t in zip(sizes, seconds)]
    y = [(t - alpha) / t for t in seconds]
    beta = sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x)
    return {"beta": beta, "residuals": [(t - alpha - n * beta) / t for n, t in zip(sizes, seconds)]}


def model(sizes, tries):
    """The alpha-beta model chapters 10 and 11 use: alpha is the latency, the fastest try at the
    smallest size; beta is fitted through the fastest try per size with alpha held there
    (`fit_slope`), so alpha + n beta is the model and its residuals are the model's. A line with a
    free intercept (`fit_line`) is returned beside it: its intercept is a fit parameter, not a
    latency, and its residuals are the line's."""
    fastest = [min(t) for t in tries]
    alpha = fastest[sizes.index(min(sizes))]
    used, line = fit_slope(sizes, fastest, alpha), fit_line(sizes, fastest)
    return {"alpha": alpha, "beta": used["beta"], "residuals": used["residuals"],
            "intercept": line["alpha"], "line_beta": line["beta"], "line_residuals": line["residuals"]}


def bootstrap_crossover(sizes, tries, p, draws=1000, seed=0, level=0.95):
    """M* with a resampling spread: each draw resamples every size's tries with replacement and
    refits `model`; low and high bound the middle ``level`` of the draws' M*. A spread, with no
    coverage claim: alpha is a minimum, and a resampled minimum is never below the sample's, so the
    draws lean one way and the spread is shifted and too narrow to be a confidence interval.
    Returns estimate, low, high, draws and share (the draws' share within [low, high])."""
    rng = random.Random(seed)
    base = model(sizes, tries)
    stars = []
    for _ in range(draws):
        m = model(sizes, [[rng.choice(t) for _ in t] for t in tries])
        stars.append(crossover(m["alpha"], m["beta"], p) or float("nan"))
    stars = [x for x in stars if x == x]                     # a draw with beta <= 0 has no M*
    if not stars:
        return {"estimate": None, "low": None, "high": None, "draws": 0, "share": None}
    draws = len(stars)
    stars.sort()
    lo, hi = stars[int((1 - level) / 2 * draws)], stars[int((1 + level) / 2 * draws) - 1]
    return {"estimate": crossover(base["alpha"], base["beta"], p), "low": lo, "high": hi, "draws": draws,
            "share": sum(lo <= x <= hi for x in stars) / draws}


def doubling_rounds(p):
    """Rounds on recursive doubling's critical path: lg p, plus the fold and unfold of the
    r = p - 2^floor(lg p) extra ranks when p is not a power of two (MPICH's whole-buffer fold;
    TRG 2005, section 4, swap half-buffers)."""
    lg = p.bit_length() - 1
    return lg if p & (p - 1) == 0 else lg + 2


def costs(p):
    """Per all-reduce algorithm, (rounds, bytes per byte of n) on its critical path, the two
    numbers alpha and beta multiply: the ring's 2(p-1) rounds of n/p bytes (Patarasuk & Yuan 2009),
    and recursive doubling's rounds, fold and unfold included, each moving the whole n.
    The tests set both beside the rounds and bytes the hand algorithms were counted to send."""
    if p < 2:
        raise ValueError(f"a crossover needs at least 2 ranks, not {p}.")
    rounds = doubling_rounds(p)
    return {"ring": (2 * (p - 1), 2 * (p - 1) / p), "recursive_doubling": (rounds, rounds)}


def faster_than_alpha(sizes, fastest, alpha):
    """{size: seconds} for the sizes above the smallest whose fastest try beat alpha, the smallest
    size's: any message costs at least the link's latency, so each such try makes alpha an upper bound
    (chapter 10's check, and chapter 11's)."""
    return {n: t for n, t in zip(sizes, fastest) if n > min(sizes) and t < alpha}


def crossover(alpha, beta, p):
    """Bytes below which recursive doubling's all-reduce beats the ring's, or None where one wins
    at every size (p = 2: doubling saves one alpha and sends the same bytes).

    With T = R alpha + b n beta for (R, b) = `costs(p)`, the times are equal at
    n* = (R_ring - R_doubling) alpha / ((b_doubling - b_ring) beta).
    """
    (r_ring, b_ring), (r_rd, b_rd) = costs(p)["ring"], costs(p)["recursive_doubling"]
    if b_rd - b_ring <= 0 or alpha <= 0 or beta <= 0:
        return None
    return (r_ring - r_rd) * alpha / ((b_rd - b_ring) * beta)


def _library_call(op, s, p):
    """A zero-argument call of the library's ``op`` on an M-byte buffer (nccl-tests' S)."""
    dev = launch.device()
    if op == "all_reduce":
        x = torch.ones(s // 4, device=dev)
        return (lambda: dist.all_reduce(x)), x
    if op == "broadcast":
        x = torch.ones(s // 4, device=dev)
        return (lambda: dist.broadcast(x, 0)), x
    big, small = torch.ones(s // 4, device=dev), torch.ones(s // 4 // p, device=dev)
    if op == "all_gather":
        return (lambda: comm.all_gather_single(big, small)), big
    return (lambda: comm.reduce_scatter_single(small, big)), big


def rank_bench(rank, world_size, ops, sizes, repeats):
    """One rank: the seconds of every repeat per (op, size), ops by rows (each repeat after a barrier,
    so repeat i of every rank is one call of the collective)."""
    rows = []
    for op in ops:
        row = []
        for s in sizes:
            call, t = _library_call(op, s, world_size)
            row.append(_median_seconds(call, repeats, stat=list))
        rows.append(row)
    return rows


def bench(world_size, ops=BENCH_OPS, sizes=BENCH_SIZES, repeats=9, timeout=300.0):
    """Rows of op, nbytes (M, nccl-tests' S), seconds (the median over repeats of the slowest
    rank's time), low and high (the order statistics that hold that median with probability
    `coverage`, at least 95 %: 96 % for 9 repeats, `labs.measure.intervals`), algbw and busbw
    (bytes/s, from the median). Each (op, size) is timed in its own block, one after another, not
    interleaved and not paired: a change of load between blocks moves a whole block, so intervals
    that do not overlap still do not order two sizes; overlapping ones say "not ordered"."""
    k, coverage = intervals.median_ranks(repeats)          # refuses too few repeats before spawning
    for s in sizes:
        if s % (4 * world_size):
            raise ValueError(f"size {s} must be a multiple of 4 * world size = {4 * world_size} bytes.")
    ranks = launch.spawn(rank_bench, world_size, list(ops), list(sizes), repeats, timeout=timeout)
    rows = []
    for i, op in enumerate(ops):
        for j, s in enumerate(sizes):
            slowest = sorted(max(r[i][j][n] for r in ranks) for n in range(repeats))
            seconds = statistics.median(slowest)
            rows.append({"op": op, "nbytes": s, "seconds": seconds,
                         "low": slowest[k - 1], "high": slowest[repeats - k],
                         **bus_bandwidth.bandwidths(s, seconds, world_size, op)})
    return {"world_size": world_size, "backend": preflight.choose_backend(world_size), "rows": rows,
            "coverage": coverage}


def table(result):
    """nccl-tests' columns: size, time, algbw, busbw (GB/s = 1e9 bytes/s, as nccl-tests prints)."""
    level = f"{100 * result['coverage']:.0f}% interval us"
    lines = [f"{'op':>15} {'size B':>10} {'time us':>9} {level:>17} "
             f"{'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in result["rows"]:
        lines.append(f"{r['op']:>15} {r['nbytes']:>10} {r['seconds'] * 1e6:>9.0f} "
                     f"{r['low'] * 1e6:>8.0f}-{r['high'] * 1e6:<8.0f} "
                     f"{r['algbw'] / 1e9:>11.3f} {r['busbw'] / 1e9:>11.3f}")
    return "\n".join(lines)
