"""The launcher's half under torchrun: one process per GPU, across nodes (see labs.launcher.launch).

torchrun starts the ranks, so the promises of `labs.launcher.launch.spawn` are kept from inside each rank,
as far as torchrun allows: a rank's own error is raised as a RankError with its traceback and
written to torchrun's error file (torchrun names the earliest as the root cause); at the timeout a
watchdog thread on every rank stops it with one message naming the hung ranks, from heartbeats
exchanged through torchrun's store, and dumps the rank's stack.
"""
import datetime
import faulthandler
import json
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from labs.launcher import heartbeat, preflight, supervise

WATCHDOG_WAIT_S = 2.0


def command(*args):
    """torchrun's command line as ``python -m torch.distributed.run``, run by this interpreter: a
    ``torchrun`` script exists beside ``sys.executable`` only where torch was installed under the
    same prefix (not with a system Python and torch elsewhere on its path, as on a GPU box)."""
    return [sys.executable, "-m", "torch.distributed.run", *args]


def child_env(repo, **extra):
    """This process's environment for torchrun and its workers, with ``repo`` put first on
    PYTHONPATH (they do not inherit ``sys.path``) and the rest of PYTHONPATH kept after it: the
    box's own packages may live there (`tools/box_setup.py`)."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != repo]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([repo, *kept]), **extra)


def run(fn, world_size, args, kwargs, timeout, backend):
    """torchrun started us: join its group (env://), run under a watchdog, gather results on rank 0.

    The promises of `spawn` hold as far as torchrun allows: a rank's own error is raised as a
    RankError with its traceback (and written to torchrun's error file, so torchrun names it as
    the root cause); at ``timeout`` every rank stops with one message naming the hung ranks, from
    heartbeats exchanged through torchrun's store.
    """
    timeout = preflight.check_timeout(timeout)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size is not None and world_size != size:
        raise ValueError(f"--world-size {world_size} disagrees with torchrun's WORLD_SIZE={size}; "
                         "drop --world-size or make them equal.")
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    backend = preflight.choose_backend(local_size, backend, fn)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend,
                            timeout=datetime.timedelta(seconds=timeout + preflight._GROUP_TIMEOUT_MARGIN_S))
    board = _StoreBoard(rank)
    # One beat now, the last one at the deadline (the watchdog's): beats through the store are
    # socket writes, which chapter 2's wire measurement would count if they came in between.
    pulse = heartbeat.Heartbeat(board.write, period=None)
    pulse.phase = "run"  # torchrun has already started us and init_process_group has returned
    pulse.start()
    dog = threading.Timer(timeout, _torchrun_timeout, args=(board, rank, size, timeout))
    dog.daemon = True
    dog.start()
    try:
        try:
            result = fn(rank, size, *args, **kwargs)
        except Exception as exc:
            if heartbeat.is_symptom(str(exc)):
                time.sleep(2.0)  # let the rank that failed first report first: torchrun names the earliest
            error = supervise.RankError(f"rank {rank} of {size} raised {type(exc).__name__}: {exc}\n\n"
                                        f"--- rank {rank} ---\n{traceback.format_exc()}", rank)
            _torchrun_error_file(error)
            raise error from None
        pulse.stop(done=True)
        gathered = [None] * size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered
    finally:
        dog.cancel()
        pulse.stop()
        dist.destroy_process_group()


class _StoreBoard:
    """Heartbeats through torchrun's store (reachable from every node), on a connection of our own."""

    def __init__(self, rank):
        self.rank, self.lock = rank, threading.Lock()
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        self.store = dist.PrefixStore(f"labs-heartbeat-{os.environ.get('TORCHELASTIC_RUN_ID', '')}", store)

    def write(self, beat):
        with self.lock:
            self.store.set(f"beat{self.rank}", json.dumps(beat))

    def read(self, size):
        with self.lock:
            found = [r for r in range(size) if self.store.check([f"beat{r}"])]
            return {r: json.loads(self.store.get(f"beat{r}")) for r in found}


def _torchrun_timeout(board, rank, size, timeout):
    """The watchdog, on every rank at the deadline: name the hung ranks, show our stack, exit."""
    try:
        board.write(heartbeat.beat())
        # Every rank's watchdog writes its beat at its own deadline, within a second or so of ours
        # (init_process_group returned on all ranks together); then all read the same board.
        time.sleep(WATCHDOG_WAIT_S)
        beats = board.read(size)
        unfinished = [r for r in range(size) if not beats.get(r, {}).get("done")]
        message = heartbeat.timeout_message(beats, unfinished, size, timeout, time.time(),
                                            stale_s=2 * WATCHDOG_WAIT_S)
    except Exception as exc:  # the store itself may be gone: still stop, and say why the verdict is missing
        message = f"rank {rank} of {size}: the run did not finish within {timeout:g} s (no verdict: {exc})"
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    print(f"error: {message}", file=sys.stderr, flush=True)
    _torchrun_error_file(supervise.RankTimeout(message, [rank]))
    os._exit(1)


def _torchrun_error_file(error):
    """torchrun reports the error file with the earliest time as the root cause of a failed job."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        with open(path, "w") as f:
            json.dump({"message": {"message": f"{type(error).__name__}: {error}",
                                   "extraInfo": {"py_callstack": str(error),
                                                 "timestamp": str(int(time.time()))}}}, f)
