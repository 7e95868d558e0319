"""Chapter 12: a hand-built sharded checkpoint with the interface shape of torch.distributed.checkpoint.

    save(state, checkpoint_id)     # as dcp.save: every rank writes its own shard, in parallel
    load(state, checkpoint_id)     # as dcp.load: fills ``state`` in place, at any world size

``state`` is a nested dict. A `Shard` entry is this rank's 1-D piece of a larger tensor, with the
element range [offset, offset + numel) it covers in the flattened full tensor: exactly what
`labs.zero.fsdp.HandFSDP` keeps per parameter (and what FSDP2's DTensor shards carry as placements,
which DCP reads). Any other tensor or JSON value is replicated: rank 0 writes it.

On disk, each rank r writes ``rank{r}.bin`` (the raw bytes of its shards back to back, so the
file's size *is* the sharded state) and ``rank{r}.json`` (the index: key, global offset, numel,
dtype, full shape, byte position). Two rules make a checkpoint safe to restart from:
- atomic: everything goes into ``<id>.tmp``; after every rank has written, rank 0 writes
  ``metadata.json`` (the commit marker, holding the sha256 of every file) and renames the folder
  to ``<id>`` (a rename within one file system is atomic on POSIX). A save killed half-way leaves
  only a ``.tmp`` folder, which `load` refuses and `latest` skips;
- verified: `load` recomputes every file's checksum first and names the file that does not match.

Resharding is arithmetic on ranges: a rank that must hold [O, O + N) of a tensor copies the
overlap of every saved range [o, o + n) with it, whatever world size wrote them.
"""
import dataclasses
import hashlib
import json
import os
import shutil

import torch
import torch.distributed as dist

COMMIT = "metadata.json"


class IncompleteCheckpoint(RuntimeError):
    """A checkpoint whose save never committed (no commit marker)."""


class CorruptCheckpoint(RuntimeError):
    """A committed checkpoint whose file does not match its recorded checksum."""


@dataclasses.dataclass
class Shard:
    """This rank's piece of a tensor of ``shape``: flat elements [offset, offset + tensor.numel())."""
    tensor: torch.Tensor   # (n,) a view into the live shard: load writes into it
    offset: int
    shape: tuple


def _rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _flatten(state, prefix=""):
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name + ".")
        else:
            yield name, value


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_rank(state, folder, rank, on_file):
    """Write this rank's .bin (raw shard bytes) and .json (the index); returns their names."""
    index, pos = {}, 0
    binary = os.path.join(folder, f"rank{rank}.bin")
    with open(binary, "wb") as f:
        for key, v in _flatten(state):
            if isinstance(v, Shard) or (isinstance(v, torch.Tensor) and rank == 0):
                t = (v.tensor if isinstance(v, Shard) else v).detach().cpu().contiguous()
                data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
                f.write(data)
                index[key] = {"offset": v.offset if isinstance(v, Shard) else 0, "numel": t.numel(),
                              "dtype": str(t.dtype).removeprefix("torch."), "at": pos,
                              "shape": list(v.shape if isinstance(v, Shard) else t.shape),
                              "sharded": isinstance(v, Shard)}
                pos += len(data)
            elif not isinstance(v, (Shard, torch.Tensor)) and rank == 0:
                index[key] = {"value": v}
    on_file(binary)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(index, f)
    on_file(os.path.join(folder, f"rank{rank}.json"))
    return [f"rank{rank}.bin", f"rank{rank}.json"]


def save(state, checkpoint_id, on_file=lambda path: None):
    """Write ``state`` to folder ``checkpoint_id`` atomically (see the module docstring); every rank
    calls it. ``on_file(path)`` runs after each file a rank writes (the lab pauses there to be killed)."""
    rank, world = _rank_world()
    tmp = f"{checkpoint_id}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)   # a previous killed save of the same step
        os.makedirs(tmp)
    _barrier()
    names = _write_rank(state, tmp, rank, on_file)
    sums = {n: sha256(os.path.join(tmp, n)) for n in names}
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, sums)
    else:
        gathered = [sums]
    if rank == 0:
        meta = {"world_size": world, "sha256": {k: v for s in gathered for k, v in s.items()}}
        with open(os.path.join(tmp, COMMIT), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, checkpoint_id)            # the commit: the folder appears whole or not at all
    _barrier()


def verify(checkpoint_id):
    """The metadata of a committed, intact checkpoint; else a one-sentence error naming what is wrong."""
    meta_path = os.path.join(checkpoint_id, COMMIT)
    if checkpoint_id.endswith(".tmp") or not os.path.exists(meta_path):
        raise IncompleteCheckpoint(f"checkpoint {checkpoint_id} has no {COMMIT}: its save never committed "
                                   "(killed half-way?); load the previous checkpoint (see latest()).")
    with open(meta_path) as f:
        meta = json.load(f)
    for name, expected in sorted(meta["sha256"].items()):
        if sha256(os.path.join(checkpoint_id, name)) != expected:
            raise CorruptCheckpoint(f"checkpoint {checkpoint_id}: file {name} does not match its sha256 "
                                    "checksum; it is corrupt, restore from the previous checkpoint.")
    return meta


def _read_index(checkpoint_id, world):
    entries = {}   # key -> [(rank, index entry)]
    for r in range(world):
        with open(os.path.join(checkpoint_id, f"rank{r}.json")) as f:
            for key, e in json.load(f).items():
                entries.setdefault(key, []).append((r, e))
    return entries


def _read(checkpoint_id, rank, e, lo, hi):
    """Elements [lo, hi) of the range a saved entry covers, read from its rank's .bin."""
    dtype = getattr(torch, e["dtype"])
    size = torch.empty((), dtype=dtype).element_size()
    with open(os.path.join(checkpoint_id, f"rank{rank}.bin"), "rb") as f:
        f.seek(e["at"] + (lo - e["offset"]) * size)
        data = bytearray(f.read((hi - lo) * size))
    return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)


def load(state, checkpoint_id):
    """Fill ``state`` in place from a verified checkpoint written at any world size; returns the
    non-tensor values by their dotted keys, e.g. {"extra.loader.consumed": 36} (the caller hands
    them to loader.load_state_dict, the LR scheduler, ...)."""
    meta = verify(checkpoint_id)
    saved = _read_index(checkpoint_id, meta["world_size"])
    values = {}
    for key, v in _flatten(state):
        if key not in saved:
            raise KeyError(f"checkpoint {checkpoint_id} has no entry {key!r}; was it saved by another model?")
        if isinstance(v, Shard):
            lo, hi = v.offset, v.offset + v.tensor.numel()
            for r, e in saved[key]:   # copy the overlap of every saved range with ours
                a, b = max(lo, e["offset"]), min(hi, e["offset"] + e["numel"])
                if a < b:
                    v.tensor.data[a - lo:b - lo].copy_(_read(checkpoint_id, r, e, a, b))
        elif isinstance(v, torch.Tensor):
            r, e = saved[key][0]
            v.data.copy_(_read(checkpoint_id, r, e, 0, e["numel"]).view(v.shape))
        else:
            values[key] = saved[key][0][1]["value"]
    return values


def latest(root):
    """The newest committed checkpoint folder ``root/step-N`` (``.tmp`` folders are not candidates)."""
    steps = [int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-") and not n.endswith(".tmp")
             and os.path.exists(os.path.join(root, n, COMMIT))]
    return os.path.join(root, f"step-{max(steps)}") if steps else None
