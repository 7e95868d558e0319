"""Chapter 2: all-reduce from point-to-point messages, naive and ring.

Naive: every rank sends its whole buffer to rank 0, which sums and sends the result back; rank 0
moves (N-1)*M bytes each way, so its link is the bottleneck and time grows with N.

Ring (Patarasuk & Yuan 2009; the bandwidth-optimal schedule NCCL and gloo descend from): split the
buffer into N chunks. Reduce-scatter: in step s = 0..N-2 rank r sends chunk (r - s) mod N to its
right neighbour and adds the chunk arriving from its left; afterwards rank r holds the full sum of
chunk (r + 1) mod N. All-gather: in step s it passes chunk (r + 1 - s) mod N to the right. Each
rank sends 2(N-1) chunks, 2(N-1)/N * M bytes in all, whatever N is; time in the alpha-beta model:
2(N-1)*alpha + 2(N-1)/N * M * beta.

    python -m labs.ring_allreduce --world-size 4 --numel 1000003 --algorithm ring --json
"""
import statistics
import time

import torch
import torch.distributed as dist

from labs import comm, launch

ALGORITHMS = ("ring", "naive", "library")


SEGMENT = 1 << 20  # elements per message: big enough to amortise alpha, small enough to pipeline


def _exchange(send_buf, dst, recv_buf, src, reduce_into=None):
    """Send ``send_buf`` right and receive ``recv_buf`` from the left at the same time.

    Both are cut into segments posted all at once, so a ring of sends cannot deadlock and, when
    ``reduce_into`` is given, adding one arrived segment overlaps the arrival of the next.
    Both ends know every chunk's size, so both skip an empty one.
    """
    sends = [comm.isend(seg, dst, tag=i) for i, seg in enumerate(send_buf.split(SEGMENT)) if seg.numel()]
    parts = [seg for seg in recv_buf.split(SEGMENT) if seg.numel()]
    recvs = [comm.irecv(seg, src, tag=i) for i, seg in enumerate(parts)]
    targets = reduce_into.split(SEGMENT) if reduce_into is not None else [None] * len(parts)
    for req, seg, target in zip(recvs, parts, targets):
        req.wait()
        if target is not None:
            target.add_(seg)
    for req in sends:
        req.wait()


def ring_allreduce(tensor):
    """Sum ``tensor`` over all ranks, in place, with 2(N-1) ring steps."""
    n, r = dist.get_world_size(), dist.get_rank()
    if n == 1:
        return tensor
    flat = tensor.view(-1)
    chunks = list(flat.split(comm.ring_chunks(flat.numel(), n)))
    right, left = (r + 1) % n, (r - 1) % n
    incoming = torch.empty_like(chunks[0])
    for s in range(n - 1):  # reduce-scatter: accumulate the chunk arriving from the left
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        _exchange(chunks[send_i], right, incoming[:chunks[recv_i].numel()], left, reduce_into=chunks[recv_i])
    for s in range(n - 1):  # all-gather: pass the finished chunks around the ring
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        _exchange(chunks[send_i], right, chunks[recv_i], left)
    return tensor


def naive_allreduce(tensor, root=0):
    """Sum ``tensor`` over all ranks, in place: gather to ``root``, add, send back."""
    n, r = dist.get_world_size(), dist.get_rank()
    if r == root:
        incoming = torch.empty_like(tensor)
        for src in range(n):
            if src != root:
                comm.recv(incoming, src)
                tensor.add_(incoming)
        for dst in range(n):
            if dst != root:
                comm.send(tensor, dst)
    else:
        comm.send(tensor, root)
        comm.recv(tensor, root)
    return tensor


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
    """All-reduce rank inputs; check against the exact sum; count bytes; time the median."""
    if numel < 1:
        raise ValueError(f"numel must be at least 1, got {numel}.")
    dev = launch.device()
    x = rank_input(rank, numel).to(dev)
    exact = sum(rank_input(r, numel).double() for r in range(world_size))
    with comm.counting() as tally:
        out = allreduce(x.clone(), algorithm)
    times = []
    for _ in range(repeats):
        buf = x.clone()
        dist.barrier()  # start together, so the time is the collective's, not a late rank's
        start = time.perf_counter()
        allreduce(buf, algorithm)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"max_abs_error": (out.double().cpu() - exact).abs().max().item(),
            "bytes_sent": tally.bytes_sent, "bytes_received": tally.bytes_received,
            "seconds": statistics.median(times)}


def compare(rank, world_size, numel):
    """`run` for every algorithm in one job (one spawn instead of three)."""
    return {algorithm: run(rank, world_size, numel, algorithm, repeats=1) for algorithm in ALGORITHMS}


def alpha_beta_fit(sizes_bytes, seconds, n):
    """Least-squares alpha (s per step) and beta (s per byte) of T = 2(N-1)alpha + 2(N-1)/N M beta."""
    import numpy as np
    slope, intercept = np.polyfit(np.asarray(sizes_bytes, float), np.asarray(seconds, float), 1)
    return intercept / (2 * (n - 1)), slope / (2 * (n - 1) / n)


# Chapter 2's exercises: the answers are computed here, so the book never types them.
EXERCISES = {
    "1": lambda: 2 * 7 / 8 * 14e9 / 1e9,              # GB sent per GPU: ring, N = 8, M = 14 GB
    "2": lambda: 2 * 7 / 8 * 14e9 / 450e9 * 1e3,      # ms at 450 GB/s per direction, no latency
    "3": lambda: 7 * 14e9 / 1e9,                      # GB the naive root sends for the same job
}


def check(question, answer, rel=0.01):
    from labs import exercises
    return exercises.check(EXERCISES, question, answer, rel)


def bench(rank, world_size, sizes_bytes, repeats=5, algorithms=("ring", "library")):
    """Median seconds per all-reduce for each size (fp32) and algorithm, measured in one run."""
    out = {}
    for nbytes in sizes_bytes:
        buf = torch.ones(nbytes // 4, device=launch.device())
        for algorithm in algorithms:
            allreduce(buf, algorithm)  # warm-up: connections, allocations
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                allreduce(buf, algorithm)
                times.append(time.perf_counter() - start)
            out[f"{algorithm}:{nbytes}"] = statistics.median(times)
    return out


def main(argv=None):
    from labs import cli
    p = cli.parser("All-reduce from point-to-point sends: checks the sum, counts bytes, times it.")
    p.add_argument("--numel", type=cli.positive_int, default=1 << 20, help="fp32 elements per rank")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="ring")
    p.add_argument("--repeats", type=cli.positive_int, default=5)
    args = cli.parse(p, argv)
    results = launch.launch(run, args.world_size, args.numel, args.algorithm, args.repeats, timeout=args.timeout)
    if results is None:
        return
    n, m = len(results), args.numel * 4
    result = {"world_size": n, "numel": args.numel, "algorithm": args.algorithm,
              "max_abs_error": max(r["max_abs_error"] for r in results),
              "bytes_sent": [r["bytes_sent"] for r in results],
              "bytes_received": [r["bytes_received"] for r in results],
              "bytes_sent_formula_per_rank": 2 * (n - 1) / n * m,
              "seconds": statistics.median(r["seconds"] for r in results)}
    cli.report(result, args, f"{args.algorithm} all-reduce of {m} bytes on {n} ranks: max error "
               f"{result['max_abs_error']:.2e}, bytes sent per rank {result['bytes_sent']} "
               f"(ring formula {result['bytes_sent_formula_per_rank']:.0f}), median {result['seconds'] * 1e3:.2f} ms")


if __name__ == "__main__":
    from labs import cli
    cli.main(main)
