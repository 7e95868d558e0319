"""Collectives and point-to-point calls that count the bytes each rank sends and receives.

Every lab talks through these wrappers, so it can put its bytes on the wire beside the formula:

    with comm.counting() as tally:
        comm.all_reduce(grad)
    tally.bytes_sent  # what this rank sent

Point-to-point calls are counted exactly. A library collective is counted as the bandwidth-optimal
ring would move it (the definition behind nccl-tests' "bus bandwidth"): for M bytes on N ranks,
all-reduce sends 2(N-1)/N * M per rank, all-gather and reduce-scatter (N-1)/N * M of the full
buffer. These are logical bytes: the library may choose another algorithm (gloo runs
reduce-scatter as a full all-reduce, NCCL picks trees for small messages), which the book
measures separately.
"""
import contextlib
from collections import defaultdict

import torch.distributed as dist

_active = []  # the tallies currently counting, innermost last


class Tally:
    """Calls and bytes per operation, for one rank."""

    def __init__(self):
        self.ops = defaultdict(lambda: {"calls": 0, "bytes_sent": 0, "bytes_received": 0})

    def add(self, op, sent, received):
        entry = self.ops[op]
        entry["calls"] += 1
        entry["bytes_sent"] += sent
        entry["bytes_received"] += received

    @property
    def bytes_sent(self):
        return sum(e["bytes_sent"] for e in self.ops.values())

    @property
    def bytes_received(self):
        return sum(e["bytes_received"] for e in self.ops.values())

    def calls(self, op):
        return self.ops[op]["calls"] if op in self.ops else 0

    def as_dict(self):
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "ops": {op: dict(entry) for op, entry in sorted(self.ops.items())}}


@contextlib.contextmanager
def counting():
    """Count every call made through this module inside the block (tallies may nest)."""
    tally = Tally()
    _active.append(tally)
    try:
        yield tally
    finally:
        _active.remove(tally)


def _record(op, sent, received):
    for tally in _active:
        tally.add(op, sent, received)


def _size(group):
    return dist.get_world_size(group)


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def ring_chunks(numel, n):
    """Split ``numel`` elements into ``n`` ring chunks; the first ``numel % n`` get one extra."""
    base, extra = divmod(numel, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def ring_allreduce_elements(numel, n, rank):
    """Elements rank ``rank`` sends in a ring all-reduce (reduce-scatter then all-gather).

    Reduce-scatter step s sends chunk (rank - s) mod n and all-gather step s sends chunk
    (rank + 1 - s) mod n, for s = 0 .. n-2; so each phase skips exactly one chunk.
    """
    chunks = ring_chunks(numel, n)
    reduce_scatter = sum(chunks[(rank - s) % n] for s in range(n - 1))
    all_gather = sum(chunks[(rank + 1 - s) % n] for s in range(n - 1))
    return reduce_scatter + all_gather


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    n, rank = _size(group), dist.get_rank(group)
    moved = ring_allreduce_elements(tensor.numel(), n, rank) * tensor.element_size()
    received = ring_allreduce_elements(tensor.numel(), n, (rank - 1) % n) * tensor.element_size()
    _record("all_reduce", moved, received)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(output, input, group=None, async_op=False):
    """Concatenate every rank's ``input`` into ``output`` (n times larger)."""
    n = _size(group)
    _record("all_gather", (n - 1) * _nbytes(input), (n - 1) * _nbytes(input))
    return dist.all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Sum ``input`` over ranks and keep this rank's 1/n slice in ``output``."""
    n = _size(group)
    _record("reduce_scatter", (n - 1) * _nbytes(output), (n - 1) * _nbytes(output))
    return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False):
    """Counted as a pipelined chain from ``src``: every rank but the last sends M, all but src receive M."""
    n, rank = _size(group), dist.get_rank(group)
    src_local = dist.get_group_rank(group, src) if group is not None else src
    position = (rank - src_local) % n
    _record("broadcast", _nbytes(tensor) if position < n - 1 else 0, _nbytes(tensor) if position else 0)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_to_all(output, input, group=None, async_op=False):
    """Equal splits: each rank keeps 1/n of ``input`` and sends the rest, one slice per peer."""
    n = _size(group)
    _record("all_to_all", _nbytes(input) * (n - 1) // n, _nbytes(output) * (n - 1) // n)
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def send(tensor, dst, group=None):
    _record("send", _nbytes(tensor), 0)
    dist.send(tensor, dst=dst, group=group)


def recv(tensor, src, group=None):
    _record("recv", 0, _nbytes(tensor))
    dist.recv(tensor, src=src, group=group)


def isend(tensor, dst, group=None, tag=0):
    _record("send", _nbytes(tensor), 0)
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor, src, group=None, tag=0):
    _record("recv", 0, _nbytes(tensor))
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def barrier(group=None):
    _record("barrier", 0, 0)
    dist.barrier(group=group)
