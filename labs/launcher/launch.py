"""Run a lab function on N processes with `torch.distributed` initialised (used by every chapter).

    results = spawn(fn, world_size, *args, timeout=60)

runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes and returns the list of
their return values, in rank order. The same lab also runs under ``torchrun`` (one process per
GPU, across nodes): `launch` notices torchrun's environment and calls ``fn`` in this process.

Promises, because a distributed job that hangs teaches nothing:
- a rank that raises or dies makes the call raise `RankError`, naming that rank (not the peers
  that lost their connection to it), with its traceback;
- a rank that hangs makes the call raise `RankTimeout` at ``timeout``, naming the rank the others
  waited for (from each rank's heartbeat, `labs.launcher.heartbeat`) and showing where each one was stuck;
- no process outlives the call, not even when the caller is killed (each rank asks the kernel to
  kill it with its parent, before it imports torch), and no temporary file is left behind;
- a rank costs milliseconds to start, not an `import torch`: it is forked from a process that
  imported torch once (`labs.launcher.zygote`), and imports the lab's own module afresh;
- the rendezvous goes through a file in a fresh temporary folder, so two calls at once on one
  machine never fight over a port;
- bad input (world size, timeout, a run larger than the machine's memory) is refused in one
  sentence before any process starts.

Backend: NCCL with one GPU per rank when the machine has at least ``world_size`` GPUs, else gloo
on the CPU. ``LABS_BACKEND=gloo`` or ``LABS_BACKEND=nccl`` forces one. A rank function marked
``@launch.on_cpu(reason)`` always runs on gloo; any other puts its tensors on `device()`.
"""
import importlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from labs.launcher import preflight, supervise, torchrun, zygote
from labs.launcher.preflight import on_cpu  # noqa: F401  (how a lab says it runs on the CPU)
from labs.launcher.supervise import RankError, RankTimeout  # noqa: F401  (the launcher's public errors)

_RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rank.py")


def device():
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def under_torchrun():
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def launch(fn, world_size, *args, timeout=60.0, backend=None, **kwargs):
    """Entry point of every lab's command line: spawn processes, or join torchrun's.

    Returns the list of per-rank results on the process that should report them (the caller of
    spawn, or global rank 0 under torchrun) and None on the other torchrun ranks.
    """
    if under_torchrun():
        return torchrun.run(fn, world_size, args, kwargs, timeout, backend)
    return spawn(fn, world_size, *args, timeout=timeout, backend=backend, **kwargs)


def spawn(fn, world_size, *args, timeout=60.0, backend=None, **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` new processes."""
    preflight.check_world_size(world_size)
    timeout = preflight.check_timeout(timeout)
    backend = preflight.choose_backend(world_size, backend, fn)
    preflight.check_fits(world_size)
    fn = _importable(fn)
    spec = _spec(fn, args, kwargs, world_size, backend, timeout)
    tmp = tempfile.mkdtemp(prefix="labs-spawn-")
    janitor = _start_janitor(tmp)  # removes tmp if this process is killed before its `finally`
    procs = []
    try:
        with open(os.path.join(tmp, "sys_path.json"), "w") as f:
            json.dump([os.path.abspath(p) if p else os.getcwd() for p in sys.path], f)
        with open(os.path.join(tmp, "spec.pkl"), "wb") as f:
            f.write(spec)
        for rank in range(world_size):
            procs.append(_start_rank(tmp, rank, backend))
        zygote.wait_ready(procs, timeout)  # a new zygote's import of torch is not the run's time
        unfinished, failures = supervise.wait(procs, tmp, time.monotonic() + timeout)
        if failures:  # a failure outranks a timeout: the stuck ranks wait on the failed one
            raise supervise.rank_error(failures, world_size, tmp)
        # a rank with a result waits only for its peers to finish (_rank.leave_together): not stuck
        unfinished = [r for r in unfinished if not os.path.exists(supervise.path(tmp, r,
                                                                                 "result"))] or unfinished
        if unfinished:
            raise supervise.timeout_error(procs, unfinished, world_size, timeout, tmp)
        # back on the CPU: an NCCL rank's tensors were saved on its GPU, which the caller may not hold
        results = [torch.load(supervise.path(tmp, r, "result"), weights_only=False, map_location="cpu")
                   for r in range(world_size)]
        supervise.replay_stdout(tmp, world_size)
        return results
    finally:
        supervise.stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)
        _dismiss(janitor)


def _importable(fn):
    """Ranks import ``fn`` by name, so it must live in a module, not a notebook cell or a script."""
    if getattr(fn, "__module__", None) != "__main__":
        return fn
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:  # `python -m labs.x`: re-import it under its real name
        found = getattr(importlib.import_module(spec.name), fn.__qualname__, None)
        if found is not None:
            return found
    raise ValueError(f"{fn.__qualname__} is defined in __main__ (a notebook cell or script), which a "
                     "spawned process cannot import; move it into a module under labs/.")


def _spec(fn, args, kwargs, world_size, backend, timeout):
    try:
        return pickle.dumps({"fn": fn, "args": args, "kwargs": kwargs, "world_size": world_size,
                             "backend": backend, "timeout": timeout})
    except Exception as exc:
        raise ValueError(f"cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to the ranks "
                         f"({type(exc).__name__}: {exc}); pass a module-level function and plain "
                         "values.") from None


def _start_rank(tmp, rank, backend):
    """A rank running labs/launcher/_rank.py, its stdout and stderr going to files in tmp: forked by this
    process's zygote (`labs.launcher.zygote`: torch already imported), or a fresh interpreter. NCCL ranks
    are always fresh: CUDA must not have been touched in a process before it forks, and a fresh
    interpreter is the only way to be sure of that."""
    if backend == "gloo" and zygote.enabled():
        return zygote.start_rank(tmp, rank)
    with open(supervise.path(tmp, rank, "stdout"), "wb") as out, open(supervise.path(tmp, rank, "stderr"),
                                                                      "wb") as err:
        return subprocess.Popen([sys.executable, _RANK_SCRIPT, tmp, str(rank), str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err, close_fds=True)


def _start_janitor(tmp):
    """A tiny process that outlives us only to remove ``tmp`` if we are killed (SIGTERM, SIGKILL).

    It waits on a pipe from us: "done" means we cleaned up ourselves; end-of-file without it means
    we died, and our ranks with us (parent-death signal), so it removes their folder."""
    return subprocess.Popen([sys.executable, "-c", _JANITOR, tmp], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


_JANITOR = """import shutil, sys, time
if sys.stdin.read() != "done":
    for _ in range(5):
        shutil.rmtree(sys.argv[1], ignore_errors=True)
        time.sleep(0.2)
"""


def _dismiss(janitor):
    try:
        janitor.communicate("done".encode(), timeout=5)
    except subprocess.TimeoutExpired:
        janitor.kill()
        janitor.wait()

