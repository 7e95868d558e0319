"""Chapter 2: all-reduce from point-to-point messages, naive and ring.

Naive: every rank sends its whole buffer to rank 0, which sums and sends the result back; rank 0
moves (N-1)*M bytes each way, so its link is the bottleneck and time grows with N.

Ring (Patarasuk & Yuan 2009; the bandwidth-optimal schedule NCCL and gloo descend from): split the
buffer into N chunks. Reduce-scatter: in step s = 0..N-2 rank r sends chunk (r - 1 - s) mod N to
its right neighbour and adds its own input to the chunk arriving from its left; afterwards rank r
holds the full sum of chunk r. All-gather: in step s it passes chunk (r - s) mod N to the right.
Each rank sends 2(N-1) chunks, 2(N-1)/N * M bytes in all, whatever N is; time in the alpha-beta
model: 2(N-1)*alpha + 2(N-1)/N * M * beta. The two halves are also the hand reduce-scatter and
all-gather that `comm.hand_collectives()` runs in place of the library's (any process group).

What the library sends is measured, not assumed: `library_wire_table` reads the bytes gloo
writes to its sockets (`labs.measure.wire`) beside what the ring needs.

    python -m labs.data_parallel.ring_allreduce --world-size 4 --numel 1000003 --algorithm ring --json
"""
import statistics
import time

import torch
import torch.distributed as dist

from labs.measure import comm, wire
from labs.launcher import launch, preflight

ALGORITHMS = ("ring", "naive", "library")


SEGMENT = 1 << 20  # elements per message: big enough to amortise alpha, small enough to pipeline


def _ring(group):
    """(n, r, right, left): the group's size, this rank's place in it, its neighbours' global ranks."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    to_global = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    return n, r, to_global((r + 1) % n), to_global((r - 1) % n)


def _reducer(op):
    """The in-place elementwise reduction ``a <- a op b`` for a ``dist.ReduceOp``."""
    if op == dist.ReduceOp.SUM:
        return torch.Tensor.add_
    if op == dist.ReduceOp.PRODUCT:
        return torch.Tensor.mul_
    if op == dist.ReduceOp.MAX:
        return lambda a, b: torch.maximum(a, b, out=a)
    if op == dist.ReduceOp.MIN:
        return lambda a, b: torch.minimum(a, b, out=a)
    raise ValueError(f"the hand ring reduces with SUM, PRODUCT, MAX or MIN, not {op}.")


def _exchange(send_buf, dst, recv_buf, src, group=None, combine=None):
    """Send ``send_buf`` to ``dst`` and receive ``recv_buf`` from ``src`` at the same time.

    Both are cut into segments posted all at once, so a ring of sends cannot deadlock, and
    ``combine(i, segment)``, run as segment i arrives, overlaps the arrival of the next one.
    Both ends know every chunk's size, so both skip an empty one.
    """
    sends = [comm.isend(seg, dst, group=group, tag=i) for i, seg in enumerate(send_buf.split(SEGMENT)) if seg.numel()]
    parts = [seg for seg in recv_buf.split(SEGMENT) if seg.numel()]
    recvs = [comm.irecv(seg, src, group=group, tag=i) for i, seg in enumerate(parts)]
    for i, (req, seg) in enumerate(zip(recvs, parts)):
        req.wait()
        if combine is not None:
            combine(i, seg)
    for req in sends:
        req.wait()


def ring_reduce_scatter(output, chunks, group=None, op=dist.ReduceOp.SUM):
    """Reduce ``chunks`` (any sizes, one per rank of ``group``) over the ring; chunk r's result -> ``output``.

    Step s = 0..N-2: rank r sends right the partial result of chunk (r - 1 - s) mod N (at s = 0
    its own input) and receives from the left chunk (r - 2 - s) mod N, to which it adds its own
    input; the last arrival is chunk r, reduced over all N ranks. Each rank sends every chunk but
    its own: (N-1)/N of the buffer. ``chunks`` are only read; ``output`` may be ``chunks[r]``.
    """
    n, r, right, left = _ring(group)
    if output.numel() != chunks[r].numel():
        raise ValueError(f"output has {output.numel()} elements but this rank's chunk has {chunks[r].numel()}.")
    if n == 1:
        return output.copy_(chunks[0].reshape(output.shape))
    reduce = _reducer(op)
    room = max(c.numel() for c in chunks)
    spare = [torch.empty(room, dtype=output.dtype, device=output.device) for _ in range(2)]
    outgoing = chunks[(r - 1) % n]
    for s in range(n - 1):
        own = chunks[(r - 2 - s) % n].split(SEGMENT)
        incoming = spare[s % 2][:chunks[(r - 2 - s) % n].numel()]  # the other buffer is still being sent
        _exchange(outgoing, right, incoming, left, group, combine=lambda i, seg, own=own: reduce(seg, own[i]))
        outgoing = incoming
    return output.copy_(outgoing.view(output.shape))


def ring_all_gather_(chunks, group=None):
    """In place: rank r brings ``chunks[r]``; afterwards every rank holds every chunk (any sizes).

    Step s = 0..N-2: send chunk (r - s) mod N right, receive chunk (r - 1 - s) mod N from the left;
    each rank sends every chunk but its right neighbour's: (N-1)/N of the buffer.
    """
    n, r, right, left = _ring(group)
    for s in range(n - 1):
        _exchange(chunks[(r - s) % n], right, chunks[(r - 1 - s) % n], left, group)
    return chunks


def ring_all_gather_into(output, input, group=None):
    """``all_gather_single`` by hand: ``output`` (N times ``input``) gets every rank's ``input`` in rank order."""
    if not output.is_contiguous():
        raise ValueError("the hand all-gather writes into a contiguous output tensor; pass output.contiguous().")
    n, r, _, _ = _ring(group)
    k = input.numel()
    chunks = [output.view(-1)[i * k:(i + 1) * k] for i in range(n)]
    chunks[r].copy_(input.reshape(-1))
    ring_all_gather_(chunks, group)
    return output


def ring_allreduce(tensor, group=None, op=dist.ReduceOp.SUM):
    """Reduce ``tensor`` over the ranks of ``group``, in place: ring reduce-scatter, then ring all-gather.

    The N chunks are as equal as can be (the first numel mod N get one extra element), so
    2(N-1) steps move 2(N-1)/N * M bytes per rank, whatever N is.
    """
    if not tensor.is_contiguous():
        raise ValueError("the hand ring all-reduce works in place on a contiguous tensor; pass tensor.contiguous().")
    n, r, _, _ = _ring(group)
    flat = tensor.view(-1)
    chunks = list(flat.split(comm.ring_chunks(flat.numel(), n)))
    ring_reduce_scatter(chunks[r], chunks, group, op)  # rank r's reduced chunk lands in place
    ring_all_gather_(chunks, group)
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
        start = time.perf_counter()
        allreduce(buf, algorithm)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
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
    calls = {"all_reduce": lambda: comm.all_reduce(full), "reduce_scatter": lambda: comm.reduce_scatter(shard, full),
             "all_gather": lambda: comm.all_gather(full, shard), "broadcast": lambda: comm.broadcast(full, src=0)}
    ops = {}
    for op, call in calls.items():
        with wire.measure() as w, comm.counting() as tally:
            call()
        ops[op] = {"wire_bytes": w.bytes, "formula_bytes": tally.formula_bytes_sent,
                   "payload_bytes": tally.payload_bytes,
                   "wire_minus_formula": None if w.bytes is None else w.bytes - tally.formula_bytes_sent}
    return {"rank": rank, "world_size": n, "nbytes": nbytes, "broadcast_role": "root" if rank == 0 else "non-root",
            "backend": dist.get_backend(), "wire_reason": w.reason, "ops": ops}


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
    from labs.measure import exercises
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
    from labs.launcher import cli
    p = cli.parser("All-reduce from point-to-point sends: checks the sum, counts bytes, times it.")
    p.add_argument("--numel", type=cli.positive_int, default=1 << 20, help="fp32 elements per rank")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="ring")
    p.add_argument("--repeats", type=cli.positive_int, default=5)
    args = cli.parse(p, argv)
    # per element: the input, its copy and the result in fp32, the exact sum in fp64 and its terms
    preflight.check_fits(args.world_size, 40 * args.numel, "--numel")
    results = launch.launch(run, args.world_size, args.numel, args.algorithm, args.repeats, timeout=args.timeout)
    if results is None:
        return
    n, m = len(results), args.numel * 4
    result = {"world_size": n, "numel": args.numel, "algorithm": args.algorithm,
              "max_abs_error": max(r["max_abs_error"] for r in results),
              "bytes_sent": [r["bytes_sent"] for r in results],
              "bytes_received": [r["bytes_received"] for r in results],
              "formula_bytes_sent": [r["formula_bytes_sent"] for r in results],
              "wire_bytes": [r["wire_bytes"] for r in results], "wire_reason": results[0]["wire_reason"],
              "bytes_sent_formula_per_rank": 2 * (n - 1) / n * m,
              "seconds": statistics.median(r["seconds"] for r in results)}
    cli.report(result, args, f"{args.algorithm} all-reduce of {m} bytes on {n} ranks: max error "
               f"{result['max_abs_error']:.2e}, counted bytes sent per rank {result['bytes_sent']} "
               f"(ring formula {result['bytes_sent_formula_per_rank']:.0f}), wire bytes {result['wire_bytes']}, "
               f"median {result['seconds'] * 1e3:.2f} ms")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
