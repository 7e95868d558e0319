"""Chapter 12: one name, one tensor: the check a save makes before it writes (`key_clash` shows why).

A checkpoint is a map from names to tensors. DCP writes a name that several ranks hold once,
because data-parallel replicas hold the same tensor; the hand format writes every rank's pieces,
and its loader copies each saved piece a rank asks for. Either way, two different tensors under
one name lose one of them without an error. `check_one_name` refuses such a state, on every rank
and before a byte is written: a key that several ranks save must cover the same elements with
the same bytes on each. Replicas pass; two pipeline stages that key their layers by their local
names (every stage has a ``blocks.0``) do not. `pipeline_change` calls it before either save.
"""
import hashlib

import torch
import torch.distributed as dist

from labs.checkpointing import sharded_checkpoint as sc


def _digest(t):
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def check_one_name(state, group=None):
    """Refuse, on every rank and before anything is written, a state in which one key names
    different tensors on different ranks (same key, other elements or other bytes)."""
    mine = {}
    for key, v in sc._flatten(state):
        if isinstance(v, sc.Shard):
            mine[key] = (tuple(map(tuple, (r[:2] for r in v.runs()))), _digest(v.tensor))
        elif isinstance(v, torch.Tensor):
            mine[key] = (((0, v.numel()),), _digest(v))
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    held = {}
    for rank, keys in enumerate(everyone):
        for key, what in keys.items():
            held.setdefault(key, {}).setdefault(what, []).append(rank)
    clashes = sorted((k, sorted(w.values())) for k, w in held.items() if len(w) > 1)
    if clashes:
        key, ranks = clashes[0]
        raise ValueError(f"{len(clashes)} keys name different tensors on different ranks (first: {key} "
                         f"on ranks {' and '.join(str(r[0]) for r in ranks)}): two stages saving layers "
                         "under their local names would lose one of them; key every tensor by its global "
                         "name.")
