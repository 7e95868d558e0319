"""Chapter 2: all-reduce from point-to-point messages, naive and ring, checked, counted and timed.

Naive: every rank sends its whole buffer to rank 0, which sums and sends the result back; rank 0
moves (N-1)*M bytes each way, so its link is the bottleneck and time grows with N.

Ring (Patarasuk & Yuan 2009; the algorithms are in `labs.data_parallel.hand_ring`): reduce-scatter
then all-gather, N chunks; each rank sends 2(N-1) chunks, 2(N-1)/N * M bytes in all, whatever N
is; time in the alpha-beta model: 2(N-1)*alpha + 2(N-1)/N * M * beta. This lab runs both against
the library's all-reduce on the same inputs: the exact sum, the bytes of each kind, the time.

What the library sends is measured, not assumed: `library_wire_table` reads the bytes gloo
writes to its sockets (`labs.measure.wire`) beside what the ring needs.

    python -m labs.data_parallel.ring_allreduce --world-size 4 --numel 1000003 --algorithm ring --json
"""
import math
import statistics

import torch
import torch.distributed as dist

from labs.data_parallel.hand_ring import naive_allreduce, ring_allreduce
from labs.formulas import costs, links
from labs.measure import comm, timing, wire
from labs.launcher import launch, preflight

ALGORITHMS = ("ring", "naive", "library")


def allreduce(tensor, algorithm):
    if algorithm == "ring":
        return ring_allreduce(tensor)
    if algorithm == "naive":
        return naive_allreduce(tensor)
    if algorithm == "library":
        comm.all_reduce(tensor)
        return tensor
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}.")


def rank_input(rank, numel, dtype=torch.float32):
    """Rank r's deterministic input, so any rank can rebuild every other rank's."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def run(rank, world_size, numel, algorithm="ring", repeats=3):
    """All-reduce rank inputs; check against the exact sum; count bytes; time the median.

    Three byte counts, one per kind: ``bytes_sent``/``bytes_received`` are counted messages (the
    hand algorithms; 0 for the library), ``formula_bytes_sent`` the ring formula for the library
    call (0 for the hand ones), ``wire_bytes`` what this process wrote to its sockets (gloo on
    Linux, message preambles included), or None with ``wire_reason``.
    """
    if numel < 1:
        raise ValueError(f"numel must be at least 1, got {numel}.")
    dev = launch.device()
    x = rank_input(rank, numel).to(dev)
    exact = sum(rank_input(r, numel).double() for r in range(world_size))
    out = x.clone()
    with wire.measure() as w, comm.counting() as tally:
        allreduce(out, algorithm)
    times = []
    for _ in range(repeats):
        buf = x.clone()
        dist.barrier()  # start together, so the time is the collective's, not a late rank's
        start = timing.now()
        allreduce(buf, algorithm)
        times.append(timing.now() - start)
    return {"max_abs_error": (out.double().cpu() - exact).abs().max().item(),
            "bytes_sent": tally.bytes_sent, "bytes_received": tally.bytes_received,
            "formula_bytes_sent": tally.formula_bytes_sent,
            "messages_sent": tally.calls("send"), "messages_received": tally.calls("recv"),
            "wire_bytes": w.bytes, "wire_reason": w.reason,
            "seconds": statistics.median(times)}


def library_wire_table(rank, world_size, nbytes=4_000_000):
    """What the library really sends per rank (wire bytes) beside what the ring needs (formula bytes).

    One fp32 buffer of ``nbytes``: all_reduce it, reduce_scatter it into nbytes/N, all_gather
    nbytes/N into it, broadcast it from rank 0. `labs.measure.wire` models what gloo sends from its
    source: payload plus 48-byte preambles; reduce_scatter runs a full all-reduce; all_gather
    passes each shard in two halves; broadcast is a binomial tree (the root sends M to
    ceil(log2 N) peers, a leaf writes one preamble). Measured here (4 ranks, 4,000,000 bytes,
    per rank): all_reduce 6,001,728; reduce_scatter the same; all_gather 3,000,864; broadcast
    from the root 8,000,192.
    Returns per op: wire_bytes (None where it cannot be read, see wire_reason), formula_bytes,
    payload_bytes (the tensor the call was made with) and wire_minus_formula.
    """
    n = world_size
    if nbytes < 4 * n or nbytes % (4 * n):
        raise ValueError(f"nbytes must be a positive multiple of 4 * world_size = {4 * n}, got {nbytes}.")
    dev = launch.device()
    full, shard = torch.ones(nbytes // 4, device=dev), torch.ones(nbytes // 4 // n, device=dev)
    calls = {"all_reduce": lambda: comm.all_reduce(full),
             "reduce_scatter": lambda: comm.reduce_scatter(shard, full),
             "all_gather": lambda: comm.all_gather(full, shard),
             "broadcast": lambda: comm.broadcast(full, src=0)}
    ops = {}
    for op, call in calls.items():
        with wire.measure() as w, comm.counting() as tally:
            call()
        ops[op] = {"wire_bytes": w.bytes, "formula_bytes": tally.formula_bytes_sent,
                   "payload_bytes": tally.payload_bytes,
                   "wire_minus_formula": None if w.bytes is None else w.bytes - tally.formula_bytes_sent}
    return {"rank": rank, "world_size": n, "nbytes": nbytes,
            "broadcast_role": "root" if rank == 0 else "non-root", "backend": dist.get_backend(),
            "wire_reason": w.reason, "ops": ops}


def compare(rank, world_size, numel):
    """`run` for every algorithm in one job (one spawn instead of three)."""
    return {algorithm: run(rank, world_size, numel, algorithm, repeats=1) for algorithm in ALGORITHMS}


def alpha_beta_fit(sizes_bytes, seconds, n):
    """Least-squares alpha (s per step) and beta (s per byte) of T = 2(N-1)alpha + 2(N-1)/N M beta."""
    import numpy as np
    slope, intercept = np.polyfit(np.asarray(sizes_bytes, float), np.asarray(seconds, float), 1)
    return intercept / (2 * (n - 1)), slope / float(costs.factor("all_reduce", n))


def resolved_alpha(alpha, beta, smallest_bytes, smallest_times_s, n):
    """A fitted alpha, or None where the fit does not resolve it.

    A line through medians dominated by large messages (and bent by load at the largest) can have a
    negative intercept, or one that no small message shows. So alpha stands only where 0 <= alpha,
    its 2(N-1) steps fit in the fastest time of the smallest message, and the fitted line's time for
    the smallest message lies within that message's measured repeats (fastest to slowest): a fit
    that misses the small messages it claims to describe has no latency to report."""
    fastest, slowest = min(smallest_times_s), max(smallest_times_s)
    predicted = 2 * (n - 1) * alpha + float(costs.factor("all_reduce", n)) * smallest_bytes * beta
    ok = 0 <= alpha and 2 * (n - 1) * alpha <= fastest and fastest <= predicted <= slowest
    return alpha if ok else None


def resolved_beta(alpha, beta, sizes_bytes, medians_s):
    """A fitted beta, or None where the fit does not resolve it.

    Slope and intercept come from one least-squares line, so a fit whose alpha is rejected
    (``alpha`` is None: `resolved_alpha` refused it) has no trustworthy slope either: the load
    that pushed the intercept below zero also set the slope, mostly through the largest message.
    Beta stands only where alpha does, beta > 0, and the medians rise with size (a larger message
    that ran faster than a smaller one shows load, not bandwidth). Where it does not, report
    `throughput` per size instead."""
    order = sorted(range(len(sizes_bytes)), key=lambda i: sizes_bytes[i])
    rising = all(medians_s[a] <= medians_s[b] for a, b in zip(order, order[1:]))
    return beta if alpha is not None and beta > 0 and rising else None


def throughput(nbytes, times_s):
    """Measured, not fitted: bytes per second of each repeat, their median and the interval that
    holds it with >= 95 % (`labs.measure.intervals.median_ranks`), in bytes/s."""
    from labs.measure import intervals
    rates = sorted(nbytes / t for t in times_s)
    k, coverage = intervals.median_ranks(len(rates))
    return {"median": statistics.median(rates), "low": rates[k - 1], "high": rates[len(rates) - k],
            "coverage": coverage, "n": len(rates)}


def alpha_bound(smallest_times_s, n):
    """A direct measurement: the fastest all-reduce of the smallest message bounds alpha from above,
    alpha <= fastest / 2(N-1) (its 2(N-1) steps each pay alpha, plus a bandwidth term >= 0)."""
    return min(smallest_times_s) / (2 * (n - 1))


def alpha_bound_over(times_by_size, n):
    """The tightest direct bound on alpha from several small messages: every all-reduce of any size
    takes at least its 2(N-1) latency terms, so alpha <= min over sizes and repeats of T / 2(N-1).
    Returns (bound in seconds, the size that set it). Taking the smallest size alone is valid but
    loose where load inflated it: on a shared machine a larger message's fastest run can be faster."""
    size = min(times_by_size, key=lambda s: min(times_by_size[s]))
    return alpha_bound(times_by_size[size], n), size


def compute_bound_tokens(peak_flops, link_bytes_per_s, n=None):
    """Tokens per GPU per step above which backward hides data parallelism's all-reduce.

    Backward does about 4 Psi FLOPs per token (twice the forward's 2 Psi); the ring all-reduce of
    bf16 gradients (2 Psi bytes) sends 2(N-1)/N * 2 Psi bytes per GPU. Psi cancels:
    4 Psi T / F >= 2(N-1)/N * 2 Psi / W  <=>  T >= (N-1)/N * F / W, and F / W for large N."""
    factor = 1.0 if n is None else (n - 1) / n
    return factor * peak_flops / link_bytes_per_s


# Exercise 4's W: a ring across 8-GPU H100 nodes, ranks placed node by node, leaves each node through
# its 8 NDR NICs at once (`labs.formulas.links.ring_bandwidth`, Austin et al. 2025 Part 12): 400 GB/s.
ACROSS_NODES_BPS = links.ring_bandwidth(nodes=2, group_gpus_per_node=8)
# Exercise 5's model: 1,000 gradient tensors, 200 MB of fp32 gradients, DDP's default buckets: with the
# default cap the first bucket is capped at 1 MiB (torch 2.13, `_BucketCapacityConfig.create`:
# `dist._DEFAULT_FIRST_BUCKET_BYTES`, 1,048,576), the rest at 25 MiB.
EX5_GRAD_BYTES, BUCKET_CAP, FIRST_BUCKET_CAP = 200e6, 25 * 2**20, 2**20
EX5_BUCKETS = 1 + math.ceil((EX5_GRAD_BYTES - FIRST_BUCKET_CAP) / BUCKET_CAP)

# Chapter 2's exercises: the answers are computed here, so the book never types them.
EXERCISES = {
    "1": lambda: 2 * 7 / 8 * 14e9 / 1e9,              # GB sent per GPU: ring, N = 8, M = 14 GB
    "2": lambda: 2 * 7 / 8 * 14e9 / 450e9 * 1e3,      # ms at 450 GB/s per direction, no latency
    "3": lambda: 7 * 14e9 / 1e9,                      # GB the naive root sends for the same job
    "4": lambda: compute_bound_tokens(989e12, ACROSS_NODES_BPS),  # tokens per GPU, 8-GPU nodes, large N
    "5": lambda: 2 * 7 * 1000,                        # alpha terms: 1,000 tensors, N = 8, one each
    "6": lambda: 1,                                   # all-reduces per step, 8 micro-batches, no_sync
    "7": lambda: (1 / (2 * 10)) / (1 / 40),           # weight of a token in a 10-token micro-batch
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "1": [(14.0, "the payload M instead of what the ring sends, 2(N-1)/N M"),
          (2 * 14.0, "2M: the ring's (N-1)/N left out")],
    "2": [(lambda: 2 * 7 / 8 * 14e9 / 900e9 * 1e3, "NVLink's 900 GB/s counts both directions: 450 each way")],
    "3": [(8 * 14.0, "the root sending to itself too: N M instead of (N-1) M"),
          (7 * 14 * 2**30 / 1e9, "M read as 14 GiB: the question's M is 14 GB, 14 x 10^9 bytes, so "
           "(N-1)M = 98 GB; 98 GiB would be 105 GB"),
          (7 * 14 * 1e9 / 2**30, "the answer in GiB (2^30 bytes): the question asks for GB (10^9)")],
    "4": [(lambda: compute_bound_tokens(989e12, 50e9),
           "one NIC's 50 GB/s for the whole ring: the ring leaves each node through all 8 of its NICs "
           "(400 GB/s); 50 GB/s is W only with one GPU per node"),
          (lambda: compute_bound_tokens(989e12, 450e9),
           "NVLink's 450 GB/s: across nodes the ring is held to the node's 8 NICs, 400 GB/s"),
          (lambda: 989e12 / ACROSS_NODES_BPS * 3 / 2, "the whole step's 6 Psi FLOPs per token against the "
           "all-reduce: only backward's 4 Psi can hide it"),
          (lambda: compute_bound_tokens(989e12, ACROSS_NODES_BPS * 2**30 / 1e9),
           "W read in GiB/s: the node's 8 x 50 GB/s is 400 x 10^9 bytes/s, not 400 x 2^30"),
          (lambda: compute_bound_tokens(989e12, ACROSS_NODES_BPS, n=16),
           "(N-1)/N with N = 16, two nodes: the question takes N large, where (N-1)/N is 1")],
    "5": [(7 * 1000, "only the reduce-scatter's N-1 steps: the all-gather has as many"),
          (1000, "the ring's 2(N-1) steps per all-reduce left out"),
          (2 * 7 * EX5_BUCKETS, "with buckets: the question asks for one all-reduce per tensor")],
    "6": [(8, "one all-reduce per micro-batch: that is what no_sync avoids")],
    "7": [(1.0, "the naive and the true weights are the same only when every count is equal"),
          ((1 / (2 * 30)) / (1 / 40), "a token on rank 1, with 30 tokens: it is weighed less")],
}


def check(question, answer, rel=0.01):
    from labs.measure import exercises
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES)


def bench(rank, world_size, sizes_bytes, repeats=5, algorithms=("ring", "library")):
    """Seconds per all-reduce for each size (fp32) and algorithm, the algorithms interleaved.

    Repeat by repeat the algorithms run in turns (the order alternating), so a burst of load
    falls on both; ``out[f"{algorithm}:{size}"]`` is the median and ``...:all`` every repeat, in
    order, so that repeat i of two algorithms is a pair (`labs.measure.intervals`)."""
    out = {}
    for nbytes in sizes_bytes:
        buf = torch.ones(nbytes // 4, device=launch.device())
        times = {a: [] for a in algorithms}
        for algorithm in algorithms:
            allreduce(buf, algorithm)  # warm-up: connections, allocations
        for i in range(repeats):
            for algorithm in (algorithms if i % 2 == 0 else algorithms[::-1]):
                dist.barrier()
                start = timing.now()
                allreduce(buf, algorithm)
                times[algorithm].append(timing.now() - start)
        for algorithm in algorithms:
            out[f"{algorithm}:{nbytes}"] = statistics.median(times[algorithm])
            out[f"{algorithm}:{nbytes}:all"] = times[algorithm]
    return out


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("All-reduce from point-to-point sends: checks the sum, counts bytes, times it.")
    p.add_argument("--numel", type=cli.positive_int, default=1 << 20, help="fp32 elements per rank")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="ring")
    p.add_argument("--repeats", type=cli.positive_int, default=5)
    args = cli.parse(p, argv)
    # per element: the input, its copy and the result in fp32, the exact sum in fp64 and its terms
    preflight.check_fits(args.world_size, 40 * args.numel, "--numel")
    results = launch.launch(run, args.world_size, args.numel, args.algorithm, args.repeats,
                            timeout=args.timeout)
    if results is None:
        return
    n, m = len(results), args.numel * 4
    result = {"world_size": n, "numel": args.numel, "algorithm": args.algorithm,
              "max_abs_error": max(r["max_abs_error"] for r in results),
              "bytes_sent": [r["bytes_sent"] for r in results],
              "bytes_received": [r["bytes_received"] for r in results],
              "formula_bytes_sent": [r["formula_bytes_sent"] for r in results],
              "wire_bytes": [r["wire_bytes"] for r in results], "wire_reason": results[0]["wire_reason"],
              "bytes_sent_formula_per_rank": float(costs.sent("all_reduce", m, n)),
              "seconds": statistics.median(r["seconds"] for r in results)}
    cli.report(result, args, f"{args.algorithm} all-reduce of {m} bytes on {n} ranks: max error "
               f"{result['max_abs_error']:.2e}, counted bytes sent per rank {result['bytes_sent']} "
               f"(ring formula {result['bytes_sent_formula_per_rank']:.0f}), wire bytes "
               f"{result['wire_bytes']}, median {result['seconds'] * 1e3:.2f} ms")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
