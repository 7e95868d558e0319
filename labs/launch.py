"""Run a lab function on N processes with `torch.distributed` initialised (used by every chapter).

    results = spawn(fn, world_size, *args, timeout=60)

runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes and returns the list of
their return values, in rank order. The same lab also runs under ``torchrun`` (one process per
GPU, across nodes): `launch` notices torchrun's environment and calls ``fn`` in this process.

Promises, because a distributed job that hangs teaches nothing:
- a rank that raises makes the call raise `RankError`, naming the rank, with its traceback;
- a rank that hangs makes the call raise `RankTimeout` at ``timeout``, naming the ranks that did
  not finish and showing where each one was stuck;
- no process outlives the call, and the rendezvous goes through a file in a fresh temporary
  folder, so two calls at once on one machine never fight over a port.

Backend: NCCL with one GPU per rank when the machine has at least ``world_size`` GPUs, else gloo
on the CPU. ``LABS_BACKEND=gloo`` or ``LABS_BACKEND=nccl`` forces one.
"""
import datetime
import faulthandler
import importlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
BACKEND_ENV = "LABS_BACKEND"
# The process group's own timeout is longer than ours, so a rank blocked on a hung peer does not
# raise a generic gloo timeout first: our deadline fires and names the rank that really hung.
_GROUP_TIMEOUT_MARGIN_S = 30.0


class RankError(RuntimeError):
    """A rank raised or died. ``rank`` is the first rank that failed."""

    def __init__(self, message, rank):
        super().__init__(message)
        self.rank = rank


class RankTimeout(RankError):
    """Some ranks did not finish within the timeout. ``ranks`` lists them."""

    def __init__(self, message, ranks):
        super().__init__(message, ranks[0])
        self.ranks = ranks


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
        return _run_under_torchrun(fn, world_size, args, kwargs, timeout, backend)
    return spawn(fn, world_size, *args, timeout=timeout, backend=backend, **kwargs)


def spawn(fn, world_size, *args, timeout=60.0, backend=None, **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` new processes."""
    check_world_size(world_size)
    backend = choose_backend(world_size, backend)
    fn = _importable(fn)
    ctx = mp.get_context("spawn")  # fresh interpreters: safe with CUDA and with threads
    with tempfile.TemporaryDirectory(prefix="labs-spawn-") as tmp:
        procs = [ctx.Process(target=_worker, daemon=True, name=f"labs-rank-{rank}",
                             args=(rank, world_size, backend, tmp, timeout, fn, args, kwargs))
                 for rank in range(world_size)]
        try:
            for p in procs:
                p.start()
            unfinished, failures = _wait(procs, tmp, time.monotonic() + timeout)
            if failures:  # a failure outranks a timeout: the stuck ranks wait on the failed one
                raise _rank_error(failures, world_size, tmp)
            if unfinished:
                raise _timeout_error(procs, unfinished, world_size, timeout, tmp)
            results = [torch.load(_path(tmp, r, "result"), weights_only=False) for r in range(world_size)]
            _replay_stdout(tmp, world_size)
            return results
        finally:
            _stop(procs)


def _importable(fn):
    """Spawned processes import ``fn`` by name, so it must live in a module, not a notebook cell."""
    if getattr(fn, "__module__", None) != "__main__":
        return fn
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:  # `python -m labs.x`: re-import it under its real name
        found = getattr(importlib.import_module(spec.name), fn.__qualname__, None)
        if found is not None:
            return found
    raise ValueError(f"{fn.__qualname__} is defined in __main__ (a notebook cell or script), which a "
                     "spawned process cannot import; move it into a module under labs/.")


def _path(tmp, rank, kind):
    return os.path.join(tmp, f"rank{rank}.{kind}")


def _worker(rank, world_size, backend, tmp, timeout, fn, args, kwargs):
    """Body of one spawned rank: redirect output, join the group, run, leave a result file."""
    _die_with_parent()
    out = open(_path(tmp, rank, "stdout"), "w", buffering=1)
    err = open(_path(tmp, rank, "stderr"), "w", buffering=1)
    # Redirect the file descriptors too, so C++ warnings from gloo/NCCL land in the log, and the
    # parent can replay each rank's output in rank order instead of an interleaved jumble.
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout, sys.stderr = out, err
    if hasattr(signal, "SIGUSR1"):  # the parent asks a stuck rank where it is with SIGUSR1
        faulthandler.register(signal.SIGUSR1, file=err, all_threads=True)
    if backend == "gloo":
        # Every rank shares the CPU: one intra-op thread each avoids oversubscribing small machines.
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    else:
        torch.cuda.set_device(rank)
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout + _GROUP_TIMEOUT_MARGIN_S))
        result = fn(rank, world_size, *args, **kwargs)
        torch.save(result, _path(tmp, rank, "tmp"))
        os.replace(_path(tmp, rank, "tmp"), _path(tmp, rank, "result"))  # atomic: never half a file
    except BaseException as exc:
        record = {"time": time.time(), "type": type(exc).__name__, "message": str(exc),
                  "traceback": traceback.format_exc()}
        with open(_path(tmp, rank, "errtmp"), "w") as f:
            json.dump(record, f)
        os.replace(_path(tmp, rank, "errtmp"), _path(tmp, rank, "error"))  # the parent polls: never half a file
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _die_with_parent():
    """On Linux, ask the kernel to kill this rank if the launching process dies first."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _wait(procs, tmp, deadline, grace=2.0):
    """Wait until every rank exits, one fails, or the deadline passes.

    After the first failure the others get ``grace`` seconds to report theirs, so the earliest
    failure (the cause) is named, not a peer that merely lost its connection to it.
    """
    pending = set(range(len(procs)))
    failures = {}  # rank -> error record
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        mp.connection.wait([procs[r].sentinel for r in pending], timeout=min(left, 0.2))
        for r in sorted(pending):
            if os.path.exists(_path(tmp, r, "error")):
                with open(_path(tmp, r, "error")) as f:
                    failures[r] = json.load(f)
            if procs[r].is_alive():
                continue
            procs[r].join()
            pending.discard(r)
            if r not in failures and (procs[r].exitcode != 0 or not os.path.exists(_path(tmp, r, "result"))):
                failures[r] = {"time": _last_sign_of_life(tmp, r), "type": "died", "traceback": "",
                               "message": _exit_reason(procs[r].exitcode)}
        if failures:
            deadline = min(deadline, time.monotonic() + grace)
            if all(r in failures for r in pending):
                break
    return sorted(pending), [(record, r) for r, record in failures.items()]


def _last_sign_of_life(tmp, rank):
    """When a rank that died was last seen alive: its logs' last write. We notice a death only when we
    poll, which on a busy machine can be after a peer has already reported the broken connection;
    the death itself came before that, and after the rank's last write."""
    times = [os.path.getmtime(_path(tmp, rank, kind)) for kind in ("stdout", "stderr")
             if os.path.exists(_path(tmp, rank, kind))]
    return max(times) if times else time.time()


def _exit_reason(code):
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code} without returning a result"


def _tail(path, lines=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _rank_error(failures, world_size, tmp):
    failures.sort(key=lambda item: item[0]["time"])
    record, rank = failures[0]
    if record["type"] == "died":
        head = f"rank {rank} of {world_size} {record['message']}"
        detail = _tail(_path(tmp, rank, "stderr"))
    else:
        head = f"rank {rank} of {world_size} raised {record['type']}: {record['message']}"
        detail = record["traceback"]
    others = ", ".join(str(r) for _, r in failures[1:])
    also = f"\n(ranks {others} failed after it)" if others else ""
    return RankError(f"{head}{also}\n\n--- rank {rank} ---\n{detail}", rank)


def _timeout_error(procs, unfinished, world_size, timeout, tmp):
    """Ask each stuck rank for its stack (SIGUSR1 -> faulthandler) before it is killed."""
    for r in unfinished:
        if hasattr(signal, "SIGUSR1") and procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.5)
    stacks = "\n".join(f"--- rank {r} was here ---\n{_tail(_path(tmp, r, 'stderr'), 25)}" for r in unfinished)
    names = ", ".join(str(r) for r in unfinished)
    return RankTimeout(f"rank{'s' if len(unfinished) > 1 else ''} {names} of {world_size} did not finish "
                       f"within {timeout:g} s; all ranks were stopped. A rank waiting in a collective "
                       f"is usually waiting for a peer that is stuck elsewhere.\n\n{stacks}", unfinished)


def _stop(procs):
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _replay_stdout(tmp, world_size):
    """Print what each rank printed, in rank order, so notebooks show a deterministic log."""
    for r in range(world_size):
        text = _tail(_path(tmp, r, "stdout"), lines=10_000)
        for line in text.splitlines():
            print(f"[rank {r}] {line}")


def _run_under_torchrun(fn, world_size, args, kwargs, timeout, backend):
    """torchrun started us: join its group (env://), run, and gather the results on rank 0."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size is not None and world_size != size:
        raise ValueError(f"--world-size {world_size} disagrees with torchrun's WORLD_SIZE={size}; "
                         "drop --world-size or make them equal.")
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    backend = choose_backend(local_size, backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(rank, size, *args, **kwargs)
        gathered = [None] * size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered
    finally:
        dist.destroy_process_group()


def hello(rank, world_size):
    """The smallest lab: every rank contributes its rank to an all-reduce."""
    t = torch.tensor([float(rank)], device=device())
    dist.all_reduce(t)
    return {"rank": rank, "pid": os.getpid(), "sum_of_ranks": t.item(), "backend": dist.get_backend()}


def main(argv=None):
    """`python -m labs.launch --world-size N`: measure what starting N ranks costs here."""
    from labs import cli
    parser = cli.parser("Start N ranks, all-reduce their ranks, and time the whole call.")
    args = cli.parse(parser, argv)
    start = time.perf_counter()
    results = launch(hello, args.world_size, timeout=args.timeout)
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
    from labs import cli
    cli.main(main)
