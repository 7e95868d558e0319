"""Chapter 2: the ring built by hand from point-to-point messages, and the switch that puts it in
place of the library's collectives.

Ring (Patarasuk & Yuan 2009; the bandwidth-optimal schedule NCCL and gloo descend from): split the
buffer into N chunks. Reduce-scatter: in step s = 0..N-2 rank r sends chunk (r - 1 - s) mod N to
its right neighbour and adds its own input to the chunk arriving from its left; afterwards rank r
holds the full sum of chunk r. All-gather: in step s it passes chunk (r - s) mod N to the right.
Each rank sends 2(N-1) chunks, 2(N-1)/N * M bytes in all, whatever N is. Naive beside it: every
rank sends its whole buffer to rank 0, which sums and sends the result back.

Every message goes through `labs.measure.comm`, so it is counted as it is posted. Inside
`hand_collectives()` the library's all-reduce, all-gather and reduce-scatter (`comm.all_reduce`,
...) run as these rings on any process group, their messages counted under the collective's name:
that is how chapters 3 and 6 count what a sharded step sends.
"""
import functools

import torch
import torch.distributed as dist

from labs.measure import comm

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
    sends = [comm.isend(seg, dst, group=group, tag=i) for i, seg in enumerate(send_buf.split(SEGMENT))
             if seg.numel()]
    parts = [seg for seg in recv_buf.split(SEGMENT) if seg.numel()]
    recvs = [comm.irecv(seg, src, group=group, tag=i) for i, seg in enumerate(parts)]
    for i, (req, seg) in enumerate(zip(recvs, parts)):
        req.wait()
        if combine is not None:
            combine(i, seg)
    for req in sends:
        req.wait()


def ring_reduce_scatter(output, chunks, group=None, op=dist.ReduceOp.SUM, on_step=None):
    """Reduce ``chunks`` (any sizes, one per rank of ``group``) over the ring; chunk r's result -> ``output``.

    Step s = 0..N-2: rank r sends right the partial result of chunk (r - 1 - s) mod N (at s = 0
    its own input) and receives from the left chunk (r - 2 - s) mod N, to which it adds its own
    input; the last arrival is chunk r, reduced over all N ranks. Each rank sends every chunk but
    its own: (N-1)/N of the buffer. ``chunks`` are only read; ``output`` may be ``chunks[r]``.
    ``on_step(s, k, partial)``, if given, sees after each step the chunk k that arrived, reduced
    with this rank's input (chapter 2 draws the ring's steps from what it sees).
    """
    n, r, right, left = _ring(group)
    if output.numel() != chunks[r].numel():
        raise ValueError(f"output has {output.numel()} elements but this rank's chunk has "
                         f"{chunks[r].numel()}.")
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
        if on_step is not None:
            on_step(s, (r - 2 - s) % n, incoming)
        outgoing = incoming
    return output.copy_(outgoing.view(output.shape))


def ring_all_gather_(chunks, group=None, on_step=None):
    """In place: rank r brings ``chunks[r]``; afterwards every rank holds every chunk (any sizes).

    Step s = 0..N-2: send chunk (r - s) mod N right, receive chunk (r - 1 - s) mod N from the left;
    each rank sends every chunk but its right neighbour's: (N-1)/N of the buffer. ``on_step(s, k,
    chunk)``, if given, sees after each step the chunk k that arrived.
    """
    n, r, right, left = _ring(group)
    for s in range(n - 1):
        _exchange(chunks[(r - s) % n], right, chunks[(r - 1 - s) % n], left, group)
        if on_step is not None:
            on_step(s, (r - 1 - s) % n, chunks[(r - 1 - s) % n])
    return chunks


def ring_all_gather_into(output, input, group=None):
    """``all_gather_single`` by hand: ``output`` (N times ``input``) gets every rank's ``input`` in
    rank order."""
    if not output.is_contiguous():
        raise ValueError("the hand all-gather writes into a contiguous output tensor; pass "
                         "output.contiguous().")
    n, r, _, _ = _ring(group)
    k = input.numel()
    chunks = [output.view(-1)[i * k:(i + 1) * k] for i in range(n)]
    chunks[r].copy_(input.reshape(-1))
    ring_all_gather_(chunks, group)
    return output


def ring_allreduce(tensor, group=None, op=dist.ReduceOp.SUM, on_step=None):
    """Reduce ``tensor`` over the ranks of ``group``, in place: ring reduce-scatter, then ring all-gather.

    The N chunks are as equal as can be (the first numel mod N get one extra element), so
    2(N-1) steps move 2(N-1)/N * M bytes per rank, whatever N is. ``on_step(phase, s, k, chunk)``,
    if given, sees each step's arriving chunk (phase "reduce-scatter" or "all-gather").
    """
    if not tensor.is_contiguous():
        raise ValueError("the hand ring all-reduce works in place on a contiguous tensor; pass "
                         "tensor.contiguous().")
    n, r, _, _ = _ring(group)
    flat = tensor.view(-1)
    chunks = list(flat.split(comm.ring_chunks(flat.numel(), n)))
    watch = {phase: None if on_step is None else functools.partial(on_step, phase)
             for phase in ("reduce-scatter", "all-gather")}
    # rank r's reduced chunk lands in place
    ring_reduce_scatter(chunks[r], chunks, group, op, on_step=watch["reduce-scatter"])
    ring_all_gather_(chunks, group, on_step=watch["all-gather"])
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


def ring_reduce_scatter_flat(output, input, group=None, op=dist.ReduceOp.SUM):
    """``reduce_scatter_single`` by hand: ``input`` (N times ``output``) reduced, this rank's slice in
    ``output``."""
    n, k = dist.get_world_size(group), output.numel()
    flat = input.reshape(-1)
    return ring_reduce_scatter(output, [flat[i * k:(i + 1) * k] for i in range(n)], group=group, op=op)


def hand_collectives():
    """Inside the block `comm.all_reduce`, `comm.all_gather` and `comm.reduce_scatter` run as the hand
    rings above, of counted messages. Same signatures as the library calls; the hand ring runs
    synchronously even with ``async_op=True`` and returns an already-completed work object."""
    return comm.substituted(all_reduce=ring_allreduce, all_gather=ring_all_gather_into,
                            reduce_scatter=ring_reduce_scatter_flat)
