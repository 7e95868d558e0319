"""Chapter 12: which saved byte ranges each rank of a new layout reads, by the load's own rule.

The chapter's picture of resharding by ranges is drawn from this. A tensor is saved by one layout
and loaded by another; each piece is the hand format's `Shard`, and the overlaps are those of
`sharded_checkpoint.overlaps`, the function `sharded_checkpoint.load` copies by. Two layouts:
FSDP's even split of the flat tensor, padded to a multiple of the world size (`flat_shards`), and a
split of a matrix's columns, dim 1, as a row-parallel layer keeps them (`column_shards`).
"""
import math

import torch

from labs.checkpointing import sharded_checkpoint as sc
from labs.checkpointing.checkpoint_cost import shard_range


def flat_shards(shape, world_size):
    """Each rank's piece of the flat tensor under FSDP's even split; the padding is never a piece."""
    numel = math.prod(shape)
    out = []
    for r in range(world_size):
        a, b = shard_range(numel, world_size, r)
        out.append(sc.Shard(torch.empty(b - a), a, tuple(shape)))
    return out


def column_shards(shape, world_size):
    """Each rank's piece of a (rows, cols) matrix split along dim 1: one short run in every row."""
    rows, cols = shape
    if cols % world_size:
        raise ValueError(f"{cols} columns do not split evenly over {world_size} ranks")
    w = cols // world_size
    grid = torch.arange(rows * cols).view(rows, cols)
    return [sc.Shard(torch.empty(rows * w), 0, tuple(shape), grid[:, r * w:(r + 1) * w].reshape(-1))
            for r in range(world_size)]


def plan(saved, new, element_size=4):
    """For each new piece, what it reads: dicts with the saved rank, the global elements
    [start, end), where they go in the new piece (``at``) and the byte range [lo, hi) inside the
    saved piece's data (``bytes``), in the order the load copies them."""
    out = []
    for piece in new:
        reads = []
        for r, s in enumerate(saved):
            runs = [(a, b) for a, b, _ in s.runs()]
            for lo, hi, at, pos in sc.overlaps(piece.runs(), runs):
                reads.append({"saved_rank": r, "start": lo, "end": hi, "at": at,
                              "bytes": (pos * element_size, (pos + hi - lo) * element_size)})
        out.append(sorted(reads, key=lambda d: d["at"]))
    return out


def replay(saved, new, reads):
    """Fill every new piece by ``reads`` from saved pieces that hold their own global indices;
    returns the new pieces' values and, per element, how often it was written. A right plan gives
    each element its own global index, written once."""
    size = 4
    data = [torch.cat([torch.arange(a, b) for a, b, _ in s.runs()]) if s.runs() else torch.empty(0)
            for s in saved]
    filled, counts = [], []
    for piece, rs in zip(new, reads):
        n = piece.tensor.numel()
        value, count = torch.full((n,), -1, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
        for d in rs:
            lo, hi = d["bytes"][0] // size, d["bytes"][1] // size
            value[d["at"]:d["at"] + hi - lo] = data[d["saved_rank"]][lo:hi]
            count[d["at"]:d["at"] + hi - lo] += 1
        filled.append(value)
        counts.append(count)
    return filled, counts


def global_indices(piece):
    """The global flat indices a piece must hold, in its own order."""
    return torch.cat([torch.arange(a, b) for a, b, _ in piece.runs()]) if piece.runs() else \
        torch.empty(0, dtype=torch.int64)
