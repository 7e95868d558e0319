"""Chapter 12: a save killed half-way, and a corrupt file, against the hand format's two safeguards.

`labs.checkpointing.sharded_checkpoint` writes a checkpoint into ``<id>.tmp`` and commits it (``metadata.json``
with every file's sha256, then one atomic rename) only after every file is written, and `load`
checks every file against its checksum first. Both are tested here on real files:

- `killed_save`: a writer *process* saves ``step-1``, starts ``step-2``, pauses after its first
  file (it says so through a flag file) and is killed with SIGKILL there. ``step-1`` must still
  load, bit for bit, and the half-written ``step-2`` must be refused with a clear error.
- `corruption`: one byte flipped in a committed checkpoint's shard file; `load` must name the file.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from labs import model as tiny
from labs.checkpointing import sharded_checkpoint as sc

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/<package>/<file>.py


def model_state(seed):
    """The tiny GPT's weights as a world-size-1 sharded state: each tensor is its own whole shard."""
    net = tiny.build(seed=seed)
    return {"model": {n: sc.Shard(p.detach().reshape(-1), 0, tuple(p.shape)) for n, p in net.named_parameters()},
            "extra": {"step": seed}}


def writer(root, flag, pause_s):
    """Run in the child process: commit step-1, then pause inside step-2's save after its first file."""
    sc.save(model_state(1), os.path.join(root, "step-1"))

    def pause(path):
        if not os.path.exists(flag):
            with open(flag, "w") as f:
                f.write(path)
            time.sleep(pause_s)       # killed here; the sleep ends a writer nobody kills

    sc.save(model_state(2), os.path.join(root, "step-2"), on_file=pause)


def _start_writer(root, flag, pause_s):
    code = f"from labs.checkpointing.checkpoint_faults import writer; writer({root!r}, {flag!r}, {pause_s!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _wait_for(flag, proc, deadline):
    while not os.path.exists(flag):
        if proc.poll() is not None:
            raise RuntimeError(f"the writer exited ({proc.returncode}) before pausing: {proc.stderr.read().decode()}")
        if time.monotonic() > deadline:
            raise TimeoutError("the writer did not reach its pause in time; raise timeout.")
        time.sleep(0.02)


def gone(pid):
    """True when no process ``pid`` exists any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def killed_save(timeout=30.0):
    """Kill a writer half-way through a save; returns what survived and what was refused."""
    with tempfile.TemporaryDirectory(prefix="ckpt-kill-") as root:
        flag = os.path.join(root, "paused")
        proc = _start_writer(root, flag, pause_s=timeout)
        try:
            _wait_for(flag, proc, time.monotonic() + timeout)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=timeout)
        left = sorted(os.listdir(os.path.join(root, "step-2.tmp")))
        latest = sc.latest(root)
        target, expected = model_state(0), model_state(1)
        sc.load(target, latest)
        previous_ok = all(torch.equal(target["model"][n].tensor, expected["model"][n].tensor)
                          for n in expected["model"])
        try:
            sc.load(model_state(0), os.path.join(root, "step-2.tmp"))
            refused = None
        except sc.IncompleteCheckpoint as exc:
            refused = str(exc).replace(root, "<root>")
    return {"killed_pid": proc.pid, "exit_signal": -proc.returncode, "writer_gone": gone(proc.pid),
            "files_in_half_written_save": left, "latest": os.path.basename(latest),
            "previous_loads_bit_exact": previous_ok, "half_written_refused": refused,
            "killed_save_recovered": previous_ok and refused is not None and os.path.basename(latest) == "step-1"}


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
        try:
            sc.load(model_state(0), path)
            error = None
        except sc.CorruptCheckpoint as exc:
            error = str(exc).replace(root, "<root>")
        # what a loader without checksums would have produced: one weight silently wrong
        raw = torch.frombuffer(bytearray(open(os.path.join(path, "rank0.bin"), "rb").read()), dtype=torch.float32)
        clean = torch.cat([s.tensor for s in model_state(1)["model"].values()])
    return {"corruption_detected": error is not None and "rank0.bin" in error, "error": error,
            "silently_wrong_values": int((raw != clean).sum())}
