"""Collectives and point-to-point calls that keep three kinds of byte counts apart.

Every lab talks through these wrappers. The book never mixes the three kinds, and neither does a
`Tally` (`comm.counting()`):

- **counted messages** (`bytes_sent`, `bytes_received`): every point-to-point message, counted
  as it is posted and logged with its peer (`messages`). A hand collective (inside `substituted`:
  chapter 2's ring reduce-scatter, all-gather and all-reduce built from `isend`/`irecv`,
  `labs.data_parallel.hand_ring`) is counted message by message, under its collective's name.
- **formula bytes** (`formula_bytes_sent`, `formula_bytes_received`): what the bandwidth-optimal
  ring would move for a *library* collective (the definition behind nccl-tests' "bus bandwidth"):
  for M bytes on N ranks all-reduce sends 2(N-1)/N * M per rank, all-gather and reduce-scatter
  (N-1)/N * M of the full buffer, a broadcast chain M. A formula is not a measurement: never
  compare it with itself.
- **the library's wire bytes** (`wire_bytes_sent` with `counting(wire=True)`, or the block
  `wire_bytes()`): the bytes this process handed to its sockets, measured by `labs.measure.wire` (wchar
  in /proc/self/io, gloo on Linux; gloo's 48-byte message preambles included). Where it cannot
  be read (NCCL, no /proc/self/io) it is None with a reason, never a guess.

Each call also records its payload (``payload_bytes``, and ``payloads``, one entry per call): the
bytes of the tensor it was called with (all_gather: the shard sent; reduce_scatter: the full input),
so a lab takes message sizes from what it actually communicated.

    with comm.counting() as tally, hand_ring.hand_collectives():
        comm.reduce_scatter(shard, flat)     # counted messages
    tally.bytes_sent

This module imports no chapter: a hand collective is handed to it (`substituted`), never looked up.
"""
import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist

from labs.measure import wire

_active = []    # the tallies currently counting, innermost last
_hand = []      # the hand collectives in use (`substituted`), innermost last
_op_name = []   # the hand collective whose messages are being counted, innermost last

# torch >= 2.12 renamed the single-tensor collectives (all_gather_into_tensor -> all_gather_single,
# reduce_scatter_tensor -> reduce_scatter_single) and deprecated the old names; torch 2.11, which
# GPU boxes run today, has only the old ones. Every lab calls these two, never a name of its own.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

FIELDS = ("calls", "bytes_sent", "bytes_received", "formula_bytes_sent", "formula_bytes_received",
          "wire_bytes_sent", "payload_bytes")


class Tally:
    """Calls and bytes per operation, for one rank; each kind of byte count in its own field."""

    def __init__(self, wire=False):
        self.wire = wire          # measure the wire around every synchronous library collective
        self.wire_missing = []    # why some collectives' wire bytes are not in wire_bytes_sent
        self.ops = defaultdict(lambda: dict.fromkeys(FIELDS, 0) | {"payloads": []})
        self.sent_to = defaultdict(int)   # counted bytes sent, per destination (global rank)
        self.messages = []                # point-to-point messages as posted: (kind, peer, bytes)

    def call(self, op, payload):
        self.ops[op]["calls"] += 1
        self.ops[op]["payload_bytes"] += payload
        self.ops[op]["payloads"].append(payload)

    def add(self, op, **fields):
        for name, value in fields.items():
            self.ops[op][name] += value

    def _sum(self, field):
        return sum(e[field] for e in self.ops.values())

    bytes_sent = property(lambda self: self._sum("bytes_sent"))        # counted messages only
    bytes_received = property(lambda self: self._sum("bytes_received"))
    formula_bytes_sent = property(lambda self: self._sum("formula_bytes_sent"))
    formula_bytes_received = property(lambda self: self._sum("formula_bytes_received"))
    wire_bytes_sent = property(lambda self: self._sum("wire_bytes_sent"))
    payload_bytes = property(lambda self: self._sum("payload_bytes"))

    def calls(self, op):
        return self.ops[op]["calls"] if op in self.ops else 0

    def as_dict(self):
        out = {f: getattr(self, f) for f in FIELDS[1:]}
        out["wire_missing"] = sorted(set(self.wire_missing))
        out["ops"] = {op: dict(e, payloads=list(e["payloads"])) for op, e in sorted(self.ops.items())}
        return out


@contextlib.contextmanager
def counting(wire=False):
    """Count every call made through this module inside the block (tallies may nest).

    ``wire=True`` also measures the wire bytes of each synchronous library collective (a barrier
    before each one: slower, so opt-in); async ones are listed in ``tally.wire_missing``.
    """
    tally = Tally(wire)
    _active.append(tally)
    try:
        yield tally
    finally:
        _active.remove(tally)


def _call(op, payload):
    for tally in _active:
        tally.call(op, payload)


def _add(op, **fields):
    for tally in _active:
        tally.add(op, **fields)


# ---- the library's wire bytes (labs.measure.wire) -----------------------------------------------------

wire_bytes = wire.measure           # comm.wire_bytes(group): the block's wire bytes, or None + reason


def _library(op, payload, sent, received, group, async_op, run):
    """Run a library collective: record its payload and formula bytes, and its wire bytes if asked."""
    _call(op, payload)
    _add(op, formula_bytes_sent=sent, formula_bytes_received=received)
    wanted = [t for t in _active if t.wire]
    if not wanted:
        return run()
    if async_op:
        for t in wanted:
            t.wire_missing.append(f"{op}: async_op=True, the window cannot close when the data has gone")
        return run()
    with wire.measure(group) as w:
        work = run()
    for t in wanted:
        if w.bytes is None:
            t.wire_missing.append(f"{op}: {w.reason}")
        else:
            t.add(op, wire_bytes_sent=w.bytes)
    return work


# ---- formula bytes of the ring -----------------------------------------------------------------

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

    Rank r ends the reduce-scatter owning chunk r, so it sends every chunk but its own in that
    phase, and every chunk but (r + 1) mod n, the one its right neighbour owns, in the all-gather.
    """
    chunks = ring_chunks(numel, n)
    return 2 * numel - chunks[rank] - chunks[(rank + 1) % n]


# ---- collectives: the library's (formula bytes) or the hand ring's (counted messages) ----------

@contextlib.contextmanager
def substituted(all_reduce, all_gather, reduce_scatter):
    """Inside the block `all_reduce`, `all_gather` and `reduce_scatter` call these hand-built
    functions instead of the library's: ``all_reduce(tensor, group, op)``, ``all_gather(output,
    input, group)``, ``reduce_scatter(output, input, group, op)``, made of this module's counted
    point-to-point calls, which are counted under the collective's name. They run synchronously
    even with ``async_op=True``, which then returns an already-completed work object. Chapter 2's
    ring: `labs.data_parallel.hand_ring.hand_collectives()`.
    """
    _hand.append({"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter})
    try:
        yield
    finally:
        _hand.pop()


class Completed:
    """What a hand collective returns for ``async_op=True``: the work is already done."""

    def __init__(self, tensor):
        self.future = torch.futures.Future()
        self.future.set_result([tensor])
        self.get_future = lambda: self.future

    def wait(self, timeout=None):
        return True

    is_completed = wait


@contextlib.contextmanager
def _counted_as(op, tensor):
    """Attribute the point-to-point messages inside the block to the hand collective ``op``."""
    _call(op, _nbytes(tensor))
    _op_name.append(op)
    try:
        yield
    finally:
        _op_name.pop()


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if _hand:
        with _counted_as("all_reduce", tensor):
            _hand[-1]["all_reduce"](tensor, group=group, op=op)
        return Completed(tensor) if async_op else None
    n, rank = _size(group), dist.get_rank(group)
    es = tensor.element_size()
    return _library("all_reduce", _nbytes(tensor), ring_allreduce_elements(tensor.numel(), n, rank) * es,
                    ring_allreduce_elements(tensor.numel(), n, (rank - 1) % n) * es, group, async_op,
                    lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def _check_sizes(op, small, big, n):
    if big.numel() != n * small.numel():
        raise ValueError(f"{op} needs the full tensor to be {n} times the shard: got {big.numel()} and "
                         f"{small.numel()} elements on {n} ranks.")


def all_gather(output, input, group=None, async_op=False):
    """Concatenate every rank's ``input`` into ``output`` (n times larger)."""
    n = _size(group)
    _check_sizes("all_gather", input, output, n)
    if _hand:
        with _counted_as("all_gather", input):
            _hand[-1]["all_gather"](output, input, group=group)
        return Completed(output) if async_op else None
    moved = (n - 1) * _nbytes(input)
    return _library("all_gather", _nbytes(input), moved, moved, group, async_op,
                    lambda: all_gather_single(output, input, group=group, async_op=async_op))


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Sum ``input`` over ranks and keep this rank's 1/n slice in ``output``."""
    n = _size(group)
    _check_sizes("reduce_scatter", output, input, n)
    if _hand:
        with _counted_as("reduce_scatter", input):
            _hand[-1]["reduce_scatter"](output, input, group=group, op=op)
        return Completed(output) if async_op else None
    moved = (n - 1) * _nbytes(output)
    return _library("reduce_scatter", _nbytes(input), moved, moved, group, async_op,
                    lambda: reduce_scatter_single(output, input, op=op, group=group, async_op=async_op))


def broadcast(tensor, src, group=None, async_op=False):
    """Formula: a pipelined chain from ``src``: every rank but the last sends M, all but src receive M."""
    n, rank = _size(group), dist.get_rank(group)
    src_local = dist.get_group_rank(group, src) if group is not None else src
    position, m = (rank - src_local) % n, _nbytes(tensor)
    return _library("broadcast", m, m if position < n - 1 else 0, m if position else 0, group, async_op,
                    lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op))


def all_to_all(output, input, group=None, async_op=False, output_split_sizes=None, input_split_sizes=None):
    """Rank j gets slice j of ``input``: equal slices, or the rows named by the split sizes (uneven,
    as expert parallelism needs; every rank must know its ``output_split_sizes`` beforehand).

    Formula bytes: everything but the slice a rank keeps for itself.
    """
    n, rank = _size(group), dist.get_rank(group)
    if input_split_sizes is None:
        sent, received = _nbytes(input) * (n - 1) // n, _nbytes(output) * (n - 1) // n
    else:
        row_in = _nbytes(input) // max(input.shape[0], 1)
        row_out = _nbytes(output) // max(output.shape[0], 1)
        sent = (sum(input_split_sizes) - input_split_sizes[rank]) * row_in
        received = (sum(output_split_sizes) - output_split_sizes[rank]) * row_out
    return _library("all_to_all", _nbytes(input), sent, received, group, async_op,
                    lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                   group=group, async_op=async_op))


# ---- point-to-point: counted messages ----------------------------------------------------------

def _message(default_op, peer=None, src=None, **fields):
    """Count one message, under the hand collective that sends it if there is one; a sent one also
    under its destination ``peer`` (a global rank), which tells the group it went through."""
    entry = ("send", peer) if peer is not None else ("recv", src)
    for tally in _active:  # each message logged with its peer: ("send", dst, bytes) or ("recv", src, bytes)
        tally.messages.append(entry + (sum(fields.values()),))
        if peer is not None:
            tally.sent_to[peer] += fields["bytes_sent"]
    if not _op_name:
        _call(default_op, sum(fields.values()))
    _add(_op_name[-1] if _op_name else default_op, **fields)


def send(tensor, dst, group=None):
    _message("send", peer=dst, bytes_sent=_nbytes(tensor))
    dist.send(tensor, dst=dst, group=group)


def recv(tensor, src, group=None):
    _message("recv", src=src, bytes_received=_nbytes(tensor))
    dist.recv(tensor, src=src, group=group)


def isend(tensor, dst, group=None, tag=0):
    _message("send", peer=dst, bytes_sent=_nbytes(tensor))
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor, src, group=None, tag=0):
    _message("recv", src=src, bytes_received=_nbytes(tensor))
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def barrier(group=None):
    _call("barrier", 0)
    dist.barrier(group=group)
