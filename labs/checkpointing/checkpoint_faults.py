"""Chapter 12: a save killed half-way, a corrupt file and the order of the fsyncs, against the hand
format's safeguards (`labs.checkpointing.sharded_checkpoint`).

- `killed_save`: a two-rank job commits ``step-1``, then starts ``step-2``; rank 0 writes both its
  files and waits for rank 1 to commit, rank 1 writes its first file and is killed there with
  SIGKILL, from outside. ``step-1`` must still load, bit for bit, and the half-written ``step-2``
  must be refused for what it lacks, not for its name: also after a copy has given it the final
  name (what a non-atomic rename on an object store leaves), and also with a marker written too
  early (a commit that did not wait for every rank).
- `corruption`: one bit flipped in a committed checkpoint's shard file; `load` must name the file.
- `durability_trace`: the ``os.fsync`` and ``os.rename`` calls of a one-rank save, in order, recorded by
  wrapping those two Python functions (not a system-call trace: an fsync made another way is not seen).
"""
import json
import os
import shutil
import signal
import tempfile
import threading
import time

import torch

from labs import model as tiny
from labs.launcher import launch
from labs.checkpointing import sharded_checkpoint as sc


def model_state(seed, rank=0, world_size=1):
    """The tiny GPT's weights, each flattened parameter split into ``world_size`` equal runs; this
    rank's run of each (world size 1: every tensor is its own whole shard)."""
    net = tiny.build(seed=seed)
    out = {}
    for n, p in net.named_parameters():
        flat = p.detach().reshape(-1)
        per = -(-flat.numel() // world_size)
        lo, hi = min(rank * per, flat.numel()), min((rank + 1) * per, flat.numel())
        out[n] = sc.Shard(flat[lo:hi].clone(), lo, tuple(p.shape))
    return {"model": out, "extra": {"step": seed}}


@launch.on_cpu(sc.ON_CPU)
def writer(rank, world_size, root, pause_s):
    """Run on every rank: commit step-1, then save step-2; rank 1 stops after its first file of
    step-2 (it says so through a flag file) and sleeps there until it is killed."""
    with open(os.path.join(root, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    sc.save(model_state(1, rank, world_size), os.path.join(root, "step-1"))

    def pause(path):
        if rank == 1 and not os.path.exists(os.path.join(root, "paused")):
            with open(os.path.join(root, "paused"), "w") as f:
                f.write(os.path.basename(path))
            time.sleep(pause_s)       # killed here; the sleep ends a writer nobody kills

    sc.save(model_state(2, rank, world_size), os.path.join(root, "step-2"), on_file=pause)


def _killer(root, rank, record, deadline):
    """From outside the job: SIGKILL ``rank`` once it has paused inside its save."""
    while time.monotonic() < deadline:
        pid = os.path.join(root, f"pid{rank}")
        if os.path.exists(os.path.join(root, "paused")) and os.path.exists(pid):
            record["pid"] = int(open(pid).read())
            os.kill(record["pid"], signal.SIGKILL)
            return
        time.sleep(0.01)


def gone(pid):
    """True when no process ``pid`` exists any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _refusal(target, path, root):
    """The error `load` raises for ``path``, with the temporary root hidden, or None if it loads."""
    try:
        sc.load(target, path)
    except (sc.IncompleteCheckpoint, sc.CorruptCheckpoint) as exc:
        return f"{type(exc).__name__}: {str(exc).replace(root, '<root>')}"
    return None


def killed_save(world_size=2, timeout=60.0):
    """Kill rank 1 of a two-rank save between the ranks' writes and before the commit; returns what
    survived, what the reader refused and why."""
    with tempfile.TemporaryDirectory(prefix="ckpt-kill-") as root:
        record = {}
        killer = threading.Thread(target=_killer, args=(root, 1, record, time.monotonic() + timeout))
        killer.start()
        try:
            launch.spawn(writer, world_size, root, timeout, timeout=timeout)
            raise AssertionError("the save whose rank was killed finished")
        except launch.RankError as exc:
            error = str(exc).splitlines()[0]
        killer.join(timeout)
        half = os.path.join(root, "step-2.tmp")
        left = sorted(os.listdir(half))
        latest = sc.latest(root)
        target, expected = model_state(0), model_state(1)
        sc.load(target, latest)
        previous_ok = all(torch.equal(target["model"][n].tensor, expected["model"][n].tensor)
                          for n in expected["model"])
        # the name does not matter: the same files under the final name, as a copy would leave them
        copied = os.path.join(root, "step-2")
        shutil.copytree(half, copied)
        refusals = {"as_left": _refusal(model_state(0), half, root), "renamed": _refusal(model_state(0),
                                                                                         copied, root)}
        # a marker written too early, by a commit that did not wait for rank 1
        early = {n: sc.sha256(os.path.join(copied, n)) for n in ("rank0.bin", "rank0.json")}
        with open(os.path.join(copied, sc.COMMIT), "w") as f:
            json.dump({"world_size": world_size, "sha256": early}, f)
        refusals["early_marker"] = _refusal(model_state(0), copied, root)
        latest_after_copy = os.path.basename(sc.latest(root))
    return {"error": error, "killed_pid": record.get("pid"), "writer_gone": gone(record.get("pid", 0)),
            "files_in_half_written_save": left, "latest": os.path.basename(latest),
            "previous_loads_bit_exact": previous_ok, "refusals": refusals,
            "latest_with_early_marker": latest_after_copy,
            "killed_save_recovered": previous_ok and os.path.basename(latest) == "step-1"
            and all(refusals.values())}


def corruption(byte=1000):
    """Flip one bit of byte ``byte`` of a committed checkpoint's ``rank0.bin``; returns what `load` said
    and how many weights an unchecked load would have changed silently."""
    with tempfile.TemporaryDirectory(prefix="ckpt-corrupt-") as root:
        path = os.path.join(root, "step-1")
        sc.save(model_state(1), path)
        sc.verify(path)                                     # intact: passes
        with open(os.path.join(path, "rank0.bin"), "r+b") as f:
            f.seek(byte)
            b = f.read(1)[0]
            f.seek(byte)
            f.write(bytes([b ^ 0x10]))
        error = _refusal(model_state(0), path, root)
        # what a loader without checksums would have produced: one weight silently wrong
        raw = torch.frombuffer(bytearray(open(os.path.join(path, "rank0.bin"), "rb").read()),
                               dtype=torch.float32)
        clean = torch.cat([s.tensor for s in model_state(1)["model"].values()])
    return {"corruption_detected": error is not None and "rank0.bin" in error, "error": error,
            "silently_wrong_values": int((raw != clean).sum())}


def durability_trace():
    """The ``os.fsync`` and ``os.rename`` calls of one single-process save, in order: ("fsync", name) with
    the name of the file or folder the descriptor points to, ("rename", old, new). Linux only
    (the names come from /proc/self/fd)."""
    events, real_fsync, real_rename = [], os.fsync, os.rename
    with tempfile.TemporaryDirectory(prefix="ckpt-sync-") as root:
        def fsync(fd):
            name = os.readlink(f"/proc/self/fd/{fd}")
            events.append(("fsync", "<root>" if name == root else os.path.basename(name)))
            real_fsync(fd)

        def rename(a, b):
            events.append(("rename", os.path.basename(a), os.path.basename(b)))
            real_rename(a, b)

        os.fsync, os.rename = fsync, rename
        try:
            sc.save(model_state(1), os.path.join(root, "step-1"))
        finally:
            os.fsync, os.rename = real_fsync, real_rename
    return events
