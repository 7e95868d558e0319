"""Chapter 12: one name, one value wherever ranks overlap: the check a save makes before it writes.

A checkpoint is a map from names to tensors. DCP writes a name that several ranks hold once,
because data-parallel replicas hold the same tensor; the hand format writes every rank's pieces,
and its loader copies each saved piece a rank asks for. Either way, two different tensors under
one name lose one of them without an error. `check_one_name` refuses such a state, on every rank
and before a byte is written: ranks that save one key must agree on its global shape and dtype,
and wherever their element ranges overlap they must hold the same bytes. Replicas pass (they
overlap everywhere and agree), so do FSDP shards (disjoint ranges of one tensor); two pipeline
stages that key their layers by their local names (every stage has a ``blocks.0``) do not. It
compares bytes, not identities: two different tensors that still hold equal values (LayerNorms
at their initial values) pass, and lose nothing by being written once (`key_clash` shows why).
`pipeline_change` and `key_clash` call it before a save.
"""
import hashlib

import torch
import torch.distributed as dist

from labs.checkpointing import sharded_checkpoint as sc


def _digest(t):
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def _pieces(state):
    """{key: (runs [(start, end, at)], flat tensor, global shape)} of every tensor in ``state``."""
    out = {}
    for key, v in sc._flatten(state):
        if isinstance(v, sc.Shard):
            out[key] = (v.runs(), v.tensor, tuple(v.shape))
        elif isinstance(v, torch.Tensor):
            out[key] = ([(0, v.numel(), 0)], v.reshape(-1), tuple(v.shape))
    return out


def _layout(pieces):
    """What a rank tells the others first: each key's runs, shape and dtype (no bytes)."""
    return {k: ([tuple(r[:2]) for r in runs], shape, str(t.dtype)) for k, (runs, t, shape) in pieces.items()}


def _overlaps(layouts):
    """(key, lo, hi, rank a, rank b) for every overlap of two ranks' runs of one key, and the keys
    whose ranks disagree on shape or dtype; every rank computes the same lists in the same order."""
    overlaps, differ = [], set()
    for key in sorted(set().union(*layouts)):
        holders = [(r, lay[key]) for r, lay in enumerate(layouts) if key in lay]
        for i, (ra, (runs_a, *kind_a)) in enumerate(holders):
            for rb, (runs_b, *kind_b) in holders[i + 1:]:
                if kind_a != kind_b:
                    differ.add((key, ra, rb))
                overlaps += [(key, max(a0, b0), min(a1, b1), ra, rb) for a0, a1 in runs_a for b0, b1 in runs_b
                             if max(a0, b0) < min(a1, b1)]
    return overlaps, differ


def _overlap_digests(pieces, overlaps, rank):
    """This rank's digest of its bytes in each overlap it takes part in (None where it does not)."""
    out = []
    for key, lo, hi, ra, rb in overlaps:
        if rank not in (ra, rb):
            out.append(None)
            continue
        runs, t, _ = pieces[key]
        a, _, at = next(r for r in runs if r[0] <= lo and hi <= r[1])
        out.append(_digest(t[at + lo - a:at + hi - a]))
    return out


def _clashes(overlaps, differ, digests):
    """{key: (rank a, rank b)} of the first two ranks found to hold different tensors under it."""
    bad = sorted(differ) + [(k, ra, rb) for i, (k, _, _, ra, rb) in enumerate(overlaps)
                            if digests[ra][i] != digests[rb][i]]
    out = {}
    for key, ra, rb in sorted(bad):
        out.setdefault(key, (ra, rb))
    return out


def find_clashes(states):
    """The same check on the states of several ranks in one process (for tests): {key: (ra, rb)}."""
    pieces = [_pieces(s) for s in states]
    overlaps, differ = _overlaps([_layout(p) for p in pieces])
    return _clashes(overlaps, differ, [_overlap_digests(p, overlaps, r) for r, p in enumerate(pieces)])


def check_one_name(state, group=None):
    """Refuse, on every rank and before anything is written, a state in which one key names
    different tensors on different ranks (another shape or dtype, or other bytes where their
    element ranges overlap). Disjoint ranges of one key (FSDP shards) are fine."""
    pieces, world = _pieces(state), dist.get_world_size(group)
    layouts = [None] * world
    dist.all_gather_object(layouts, _layout(pieces), group=group)
    overlaps, differ = _overlaps(layouts)
    digests = [None] * world
    dist.all_gather_object(digests, _overlap_digests(pieces, overlaps, dist.get_rank(group)), group=group)
    clashes = _clashes(overlaps, differ, digests)
    if clashes:
        key, (ra, rb) = next(iter(clashes.items()))
        raise ValueError(f"{len(clashes)} keys name different tensors on different ranks (first: {key} "
                         f"on ranks {ra} and {rb}): two stages saving layers under their local names would "
                         "lose one of them; key every tensor by its global name.")
