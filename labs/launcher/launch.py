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
on the CPU. ``LABS_BACKEND=gloo`` or ``LABS_BACKEND=nccl`` forces one.
"""
import importlib
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from labs.launcher import supervise, zygote
from labs.launcher.supervise import RankError, RankTimeout  # noqa: F401  (the launcher's public errors)

BACKENDS = ("gloo", "nccl")
BACKEND_ENV = "LABS_BACKEND"
# The process group's own timeout is longer than ours, so a rank blocked on a hung peer does not
# raise a generic gloo timeout first: our deadline fires and names the rank that really hung.
_GROUP_TIMEOUT_MARGIN_S = 30.0
MAX_TIMEOUT_S = 86_400
# Resident size of one rank on gloo once torch is imported (measured: about 440 MiB).
RANK_BYTES = 450 * 1024 ** 2
MAX_RANKS_ENV = "LABS_MAX_RANKS"
_RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rank.py")


def check_world_size(world_size):
    """Refuse anything but a positive integer, in one sentence."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}; pass e.g. 2.")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}; pass e.g. 2.")
    return world_size


def choose_backend(world_size, backend=None):
    """NCCL when every rank can have its own GPU, else gloo; ``backend`` or $LABS_BACKEND forces one."""
    forced = backend or os.environ.get(BACKEND_ENV) or None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if forced is None:
        return "nccl" if gpus >= world_size else "gloo"
    if forced not in BACKENDS:
        raise ValueError(f"unknown backend {forced!r}; use one of {', '.join(BACKENDS)} "
                         f"(or unset {BACKEND_ENV} to let the launcher choose).")
    if forced == "nccl" and gpus < world_size:
        fix = f"lower the world size to {gpus} or" if gpus else "run on a GPU machine or"
        raise ValueError(f"NCCL needs one GPU per rank: {world_size} ranks asked, {gpus} GPUs here; "
                         f"{fix} set {BACKEND_ENV}=gloo.")
    return forced


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
        from labs.launcher import torchrun
        return torchrun.run(fn, world_size, args, kwargs, timeout, backend)
    return spawn(fn, world_size, *args, timeout=timeout, backend=backend, **kwargs)


def spawn(fn, world_size, *args, timeout=60.0, backend=None, **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` new processes."""
    check_world_size(world_size)
    timeout = check_timeout(timeout)
    backend = choose_backend(world_size, backend)
    check_fits(world_size)
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
        unfinished, failures = supervise.wait(procs, tmp, time.monotonic() + timeout)
        if failures:  # a failure outranks a timeout: the stuck ranks wait on the failed one
            raise supervise.rank_error(failures, world_size, tmp)
        if unfinished:
            raise supervise.timeout_error(procs, unfinished, world_size, timeout, tmp)
        results = [torch.load(supervise.path(tmp, r, "result"), weights_only=False) for r in range(world_size)]
        supervise.replay_stdout(tmp, world_size)
        return results
    finally:
        supervise.stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)
        _dismiss(janitor)


def check_timeout(timeout):
    """A number of seconds, positive and finite: 0, -1, nan and inf are refused in one sentence."""
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not ok or not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:,}, "
                         f"got {timeout!r}; pass e.g. 60.")
    return float(timeout)


def available_bytes():
    """Memory the machine can still give (MemAvailable on Linux), or None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(world_size, bytes_per_rank=0, what=""):
    """Refuse, before anything starts, a run this machine's memory cannot hold.

    Each rank is a Python process that has imported torch (RANK_BYTES, measured as its resident
    size), plus ``bytes_per_rank`` for the lab's own tensors. $LABS_MAX_RANKS overrides the limit.
    """
    override = os.environ.get(MAX_RANKS_ENV)
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"{MAX_RANKS_ENV}={override!r} is not a positive integer; unset it or set e.g. 64.")
        if world_size > int(override):
            raise ValueError(f"world_size {world_size} is above {MAX_RANKS_ENV}={override}; raise it or use fewer ranks.")
        return
    free = available_bytes()
    need = world_size * (RANK_BYTES + bytes_per_rank)
    if free is None or need <= free:
        return
    most = int(free // (RANK_BYTES + bytes_per_rank))
    gib = 1024 ** 3
    extra = f" and {bytes_per_rank / gib:,.1f} GiB for {what}" if bytes_per_rank else ""
    fix = (f"use at most {most} ranks" + (f" or lower {what}" if what else "") if most
           else f"lower {what}")
    raise ValueError(f"{world_size} ranks need about {need / gib:,.1f} GiB ({RANK_BYTES / gib:.2f} GiB per "
                     f"process{extra}) but this machine has {free / gib:,.1f} GiB available; {fix}, "
                     f"or set {MAX_RANKS_ENV} to try anyway.")


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
                         f"({type(exc).__name__}: {exc}); pass a module-level function and plain values.") from None


def _start_rank(tmp, rank, backend):
    """A rank running labs/launcher/_rank.py, its stdout and stderr going to files in tmp: forked by this
    process's zygote (`labs.launcher.zygote`: torch already imported), or a fresh interpreter. NCCL ranks
    are always fresh: CUDA must not have been touched in a process before it forks, and a fresh
    interpreter is the only way to be sure of that."""
    if backend == "gloo" and zygote.enabled():
        return zygote.start_rank(tmp, rank)
    with open(supervise.path(tmp, rank, "stdout"), "wb") as out, open(supervise.path(tmp, rank, "stderr"), "wb") as err:
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


FAULTS = ("raise", "exit", "kill", "hang")


def hello(rank, world_size, fault=None, fault_rank=None):
    """The smallest lab: every rank contributes its rank to an all-reduce.

    ``fault`` makes rank ``fault_rank`` raise, exit, be killed (SIGKILL) or hang in its own code
    between two collectives, while its peers wait for it in the second: the launcher's promises,
    tried on purpose (`python -m labs.launcher.hello --fault hang --fault-rank 1`).
    """
    t = torch.tensor([float(rank)], device=device())
    dist.all_reduce(t)
    if rank == fault_rank:
        if fault == "raise":
            raise RuntimeError(f"injected failure on rank {rank}")
        if fault == "exit":
            os._exit(3)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hang":
            while True:  # busy in its own code, as a rank in an endless data-loading loop would be
                time.sleep(0.1)
    dist.barrier()
    return {"rank": rank, "pid": os.getpid(), "sum_of_ranks": t.item(), "backend": dist.get_backend()}


def main(argv=None):
    """`python -m labs.launcher.hello --world-size N`: measure what starting N ranks costs here."""
    from labs.launcher import cli
    parser = cli.parser("Start N ranks, all-reduce their ranks, and time the whole call.")
    parser.add_argument("--fault", choices=FAULTS, help="make --fault-rank raise, exit, be killed or hang")
    parser.add_argument("--fault-rank", type=int, default=1, help="the rank --fault applies to (default 1)")
    args = cli.parse(parser, argv)
    if args.fault and not 0 <= args.fault_rank < args.world_size:
        raise ValueError(f"--fault-rank {args.fault_rank} is not a rank of {args.world_size}; "
                         f"pick one from 0 to {args.world_size - 1}.")
    start = time.perf_counter()
    results = launch(hello, args.world_size, args.fault, args.fault_rank if args.fault else None,
                     timeout=args.timeout)
    if results is None:
        return
    seconds = time.perf_counter() - start
    n = len(results)
    result = {"world_size": n, "backend": results[0]["backend"], "seconds": seconds,
              "sum_of_ranks": results[0]["sum_of_ranks"], "expected_sum": n * (n - 1) / 2}
    cli.report(result, args, f"{n} ranks on {result['backend']}: all-reduce of ranks = "
                             f"{result['sum_of_ranks']:g} (expected {result['expected_sum']:g}); "
                             f"spawn + init + run took {seconds:.2f} s")


if __name__ == "__main__":
    # Run the copy of this module that `import labs.launcher.launch` gives, so the RankError it raises is
    # the class cli.main catches (this file's own classes live in a module named __main__).
    from labs.launcher import cli, launch as imported
    cli.main(imported.main)
