"""Chapter 12: a hand-built sharded checkpoint with the interface shape of torch.distributed.checkpoint.

    save(state, checkpoint_id)     # as dcp.save: every rank writes its own shard, in parallel
    load(state, checkpoint_id)     # as dcp.load: fills ``state`` in place, at any world size
    async_save(state, checkpoint_id, group)   # as dcp.async_save: copy now, write in the background

``state`` is a nested dict. A `Shard` entry is this rank's piece of a larger tensor and the global
elements it covers, as runs of flat indices into the full tensor: one run for a data-parallel
shard (`labs.zero.fsdp.HandFSDP` keeps one per parameter), several for a tensor-parallel piece
whose rows or columns are not contiguous in memory (what FSDP2's and TP's DTensor placements
describe, and DCP reads). Any other tensor or JSON value is replicated: rank 0 writes it.

On disk, each rank r writes ``rank{r}.bin`` (the raw bytes of its shards back to back, so the
file's size *is* the sharded state) and ``rank{r}.json`` (the index: key, runs, dtype, full
shape, byte position). Two rules make a checkpoint safe to restart from:
- committed: everything goes into ``<id>.tmp``. Each rank fsyncs its files; after every rank has
  written, rank 0 writes ``metadata.json`` (the commit marker: the world size and every file's
  sha256), fsyncs it and the folder, renames the folder to ``<id>`` and fsyncs the parent folder.
  On a local POSIX file system a rename within one file system is atomic and, once the parent is
  fsynced, durable: a kill at any moment, or a power loss, leaves the previous checkpoint and
  either all of the new one or none of it. A step saved again (after a restart from an older
  checkpoint) replaces its folder only once the new one is committed. A network file system or an
  object store may not rename atomically, so the reader never trusts the name: `verify` needs a
  whole marker, and every file it lists, with the right checksum.
- verified: `load` recomputes every file's checksum first and names the file that does not match,
  and refuses a tensor whose saved pieces leave an element of the rank's shard uncovered or cover
  one twice (a wrong offset, a missing rank, two tensors under one name), or whose saved global
  shape or dtype is not the target's (`saved_shape`).

Resharding is arithmetic on ranges: a rank that must hold the runs [O, E) of a tensor copies the
overlap of every saved run [o, e) with them, whatever layout wrote them.
"""
import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import os
import shutil

import torch
import torch.distributed as dist

from labs.checkpointing.saved_shape import CoverageError, check_covered, check_same_tensor  # noqa: F401 (re-exported)

COMMIT = "metadata.json"
# why the labs that save in this format run on the CPU with gloo on every machine (`launch.on_cpu`)
ON_CPU = "the hand checkpoint format writes and hashes each tensor's bytes from host memory (.numpy())"


class IncompleteCheckpoint(RuntimeError):
    """A checkpoint whose save never committed (no commit marker, or a listed file missing)."""


class CorruptCheckpoint(RuntimeError):
    """A committed checkpoint whose file does not match its recorded checksum."""


@dataclasses.dataclass
class Shard:
    """This rank's piece of a tensor of ``shape``: its flat elements are global [offset, offset + n),
    or, when ``index`` is given, the global flat indices listed there (a tensor-parallel piece)."""
    tensor: torch.Tensor           # (n,) a view into the live shard: load writes into it
    offset: int
    shape: tuple
    index: torch.Tensor = None     # (n,) int64 global flat index of each element, or None

    def runs(self):
        """[(start, end, at)]: runs of consecutive global indices; ``at`` is where a run starts in
        ``tensor``."""
        n = self.tensor.numel()
        if self.index is None:
            return [(self.offset, self.offset + n, 0)] if n else []
        idx = self.index
        cuts = [0] + ((idx[1:] != idx[:-1] + 1).nonzero().flatten() + 1).tolist() + [n]
        return [(int(idx[a]), int(idx[a]) + b - a, a) for a, b in zip(cuts, cuts[1:]) if b > a]


def _rank_world(group=None):
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


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


def fsync_dir(path):
    """Make a folder's entries durable: fsync(2) on a file does not cover its name in the folder."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_rank(state, folder, rank, on_file):
    """Write this rank's .bin (raw shard bytes) and .json (the index), each fsynced; returns their names."""
    index, chunks, pos = {}, [], 0
    for key, v in _flatten(state):
        if isinstance(v, Shard) or (isinstance(v, torch.Tensor) and rank == 0):
            t = (v.tensor if isinstance(v, Shard) else v).detach().cpu().contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            runs = v.runs() if isinstance(v, Shard) else [(0, t.numel(), 0)]
            index[key] = {"runs": [[a, b] for a, b, _ in runs], "numel": t.numel(), "at": pos,
                          "dtype": str(t.dtype).removeprefix("torch."),
                          "shape": list(v.shape if isinstance(v, Shard) else t.shape)}
            chunks.append(data)
            pos += len(data)
        elif not isinstance(v, (Shard, torch.Tensor)) and rank == 0:
            index[key] = {"value": v}
    names = [f"rank{rank}.bin", f"rank{rank}.json"]
    for name, data in zip(names, (b"".join(chunks), json.dumps(index).encode())):
        _durable(os.path.join(folder, name), data)
        on_file(os.path.join(folder, name))
    return names


def save(state, checkpoint_id, on_file=lambda path: None, group=None):
    """Write ``state`` to folder ``checkpoint_id`` and commit it (see the module docstring); every rank
    of ``group`` calls it. ``on_file(path)`` runs after each file a rank writes (the lab pauses
    there to be killed)."""
    rank, world = _rank_world(group)
    tmp = f"{checkpoint_id}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)   # a killed save of this step (even a committed one)
        os.makedirs(tmp)
    if world > 1:
        dist.barrier(group=group)
    names = _write_rank(state, tmp, rank, on_file)
    sums = {n: sha256(os.path.join(tmp, n)) for n in names}
    gathered = [sums]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, sums, group=group)   # also: every rank has written and fsynced
    if rank == 0:
        meta = {"world_size": world, "sha256": {k: v for s in gathered for k, v in s.items()}}
        _durable(os.path.join(tmp, COMMIT), json.dumps(meta).encode())
        fsync_dir(tmp)                            # the names of every file, the marker's included
        parent, old = os.path.dirname(os.path.abspath(checkpoint_id)), f"{checkpoint_id}.old"
        if os.path.exists(checkpoint_id):         # the step saved again after a restart from an older
            shutil.rmtree(old, ignore_errors=True)   # one: move the earlier folder aside; until the next
            os.rename(checkpoint_id, old)         # rename the committed <id>.tmp is what `latest` takes
        os.rename(tmp, checkpoint_id)             # (saved again before that, it falls back one). Commit.
        fsync_dir(parent)                         # the renames themselves
        shutil.rmtree(old, ignore_errors=True)    # only now the replaced folder goes
    if world > 1:
        dist.barrier(group=group)


def _read_marker(checkpoint_id, path):
    """The commit marker's contents. It has no checksum of its own, so a marker that does not parse,
    or lacks a key, or holds a wrong type (a flipped bit, a truncated write) is a corrupt checkpoint."""
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
        ok = (type(meta["world_size"]) is int and meta["world_size"] > 0 and isinstance(meta["sha256"], dict)
              and all(isinstance(v, str) for v in meta["sha256"].values()))
    except (ValueError, KeyError, TypeError):   # bad JSON or bytes (ValueError), a key or type missing
        ok = False
    if not ok:
        raise CorruptCheckpoint(f"checkpoint {checkpoint_id}: its {COMMIT} is not a whole commit marker (bad "
                                "JSON, a key missing); it is corrupt, restore from the previous checkpoint.")
    return meta


def verify(checkpoint_id):
    """The metadata of a committed, intact checkpoint; else a one-sentence error naming what is wrong.

    Judged by content only, never by the folder's name: a checkpoint needs its commit marker, every
    file the marker lists, and each file's sha256 equal to the recorded one."""
    meta_path = os.path.join(checkpoint_id, COMMIT)
    if not os.path.exists(meta_path):
        found = sorted(n for n in os.listdir(checkpoint_id)) if os.path.isdir(checkpoint_id) else []
        raise IncompleteCheckpoint(f"checkpoint {checkpoint_id} has no {COMMIT}: its save never committed "
                                   f"(files present: {', '.join(found) or 'none'}); load the previous "
                                   "checkpoint (see latest()).")
    meta = _read_marker(checkpoint_id, meta_path)
    listed = {f"rank{r}.{ext}" for r in range(meta["world_size"]) for ext in ("bin", "json")}
    missing = sorted(n for n in listed | set(meta["sha256"]) if not os.path.exists(f"{checkpoint_id}/{n}"))
    if missing or not listed <= set(meta["sha256"]):
        raise IncompleteCheckpoint(f"checkpoint {checkpoint_id} lacks {', '.join(missing) or 'checksums'} of "
                                   f"its {meta['world_size']} ranks; load the previous checkpoint.")
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


def overlaps(mine, saved):
    """(global start, end, my position, saved position) of every overlap of two sorted run lists."""
    starts = itertools.accumulate((b - a for a, b in saved), initial=0)   # saved runs lie back to back
    saved = sorted((a, b, at) for (a, b), at in zip(saved, starts))
    out, j = [], 0
    for a, b, at in sorted(mine):
        while j < len(saved) and saved[j][1] <= a:
            j += 1
        k = j
        while k < len(saved) and saved[k][0] < b:
            s, e, pos = saved[k]
            lo, hi = max(a, s), min(b, e)
            if lo < hi:
                out.append((lo, hi, at + lo - a, pos + lo - s))
            k += 1
    return out


def load(state, checkpoint_id, reads=None):
    """Fill ``state`` in place from a verified checkpoint written under any layout; returns the
    non-tensor values by their dotted keys, e.g. {"extra.loader.consumed": 36} (the caller hands
    them to loader.load_state_dict, the LR scheduler, ...). ``reads``: a list that gets one
    (key, saved rank) for every entry of a saved file this rank copied bytes from."""
    meta = verify(checkpoint_id)
    saved = _read_index(checkpoint_id, meta["world_size"])
    blobs, values = {}, {}

    def blob(r):
        if r not in blobs:
            with open(os.path.join(checkpoint_id, f"rank{r}.bin"), "rb") as f:
                blobs[r] = f.read()
        return blobs[r]

    for key, v in _flatten(state):
        if key not in saved:
            raise KeyError(f"checkpoint {checkpoint_id} has no entry {key!r}; was it saved by another model?")
        if isinstance(v, (Shard, torch.Tensor)):
            target = v.tensor.data if isinstance(v, Shard) else v.data.view(-1)
            mine = v.runs() if isinstance(v, Shard) else [(0, target.numel(), 0)]
            check_same_tensor(checkpoint_id, key, v.shape, target.dtype, saved[key])   # `saved_shape`
            copies = [(r, e, o) for r, e in saved[key] for o in overlaps(mine, e["runs"])]
            covered = torch.zeros(target.numel(), dtype=torch.int32)   # times each element is copied
            for _, _, (lo, hi, at, _) in copies:
                covered[at:at + hi - lo] += 1
            check_covered(checkpoint_id, key, covered)   # before a byte is copied
            for r, e, (lo, hi, at, pos) in copies:   # copy the overlap of every saved run with ours
                size = torch.empty((), dtype=getattr(torch, e["dtype"])).element_size()
                if reads is not None and (key, r) not in reads[-1:]:
                    reads.append((key, r))
                start = e["at"] + pos * size
                data = bytearray(blob(r)[start:start + (hi - lo) * size])
                target[at:at + hi - lo].copy_(torch.frombuffer(data, dtype=getattr(torch, e["dtype"])))
        else:
            values[key] = saved[key][0][1]["value"]
    return values


def latest(root):
    """The newest checkpoint under ``root`` that `verify` accepts: of the ``step-N`` folders, the
    highest N whose marker, files and checksums are all there (a save killed between its marker
    and its rename leaves a complete ``step-N.tmp``, which counts; a replaced ``step-N.old`` does
    not). None if there is none."""
    found = sorted(((int(n.split("-")[1].split(".")[0]), not n.endswith(".tmp"), n) for n in os.listdir(root)
                    if n.startswith("step-") and not n.endswith(".old")), reverse=True)
    for _, _, name in found:
        try:
            verify(os.path.join(root, name))
            return os.path.join(root, name)
        except (IncompleteCheckpoint, CorruptCheckpoint):
            continue
    return None


def stage(state):
    """A copy of ``state`` whose tensors no longer share memory with training's (the staging of an
    asynchronous save: on a GPU, the device-to-host copy)."""
    def copy(v):
        t = v.tensor if isinstance(v, Shard) else v
        c = t.detach().clone() if isinstance(t, torch.Tensor) else t
        return dataclasses.replace(v, tensor=c) if isinstance(v, Shard) else c
    return {k: stage(v) if isinstance(v, dict) else copy(v) for k, v in state.items()}


_writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")


def async_save(state, checkpoint_id, group, stager=stage, on_file=lambda path: None, gate=None):
    """`save` in a background thread after ``stager`` has copied the state: returns a Future as soon
    as the copy is done. ``group``: a process group of its own (``dist.new_group()``), so the
    writer's collectives never interleave with training's on the default group. Wait on the
    previous Future before the next save. ``gate``: a threading.Event the writer waits for before
    it writes anything (the labs' slow storage)."""
    staged = stager(state)

    def write():
        if gate is not None:
            gate.wait()
        save(staged, checkpoint_id, on_file, group)

    return _writer.submit(write)
