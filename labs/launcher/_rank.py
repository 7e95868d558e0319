"""The first code a spawned rank runs (see labs.launcher.launch), in one of two ways:

- ``python labs/launcher/_rank.py TMP RANK PARENT_PID``: a fresh interpreter for one rank;
- ``python labs/launcher/_rank.py --zygote PARENT_PID``: a zygote (`labs.launcher.zygote`) that imports torch
  once, then forks one rank per request, so a rank starts in milliseconds instead of paying its own
  `import torch` (about 2 s of CPU each, most of a small lab's cost).

Either imports nothing but the standard library until it has asked the kernel to kill it when its
parent dies and has checked that the parent is still there: a parent killed while its ranks were
still importing torch must not leave them running the job on their own. A forked rank dies with
the zygote, and the zygote with the launcher, the same way.
"""
import os
import signal
import sys


def die_with_parent(parent_pid):
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above could take effect
        os._exit(1)


def run(tmp, rank, parent_pid):
    """Body of one spawned rank: join the group, run, leave a result or an error record."""
    import datetime
    import faulthandler
    import pickle
    import time
    import traceback

    import torch
    import torch.distributed as dist

    from labs.launcher import heartbeat, preflight, supervise

    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    if hasattr(signal, "SIGUSR1"):  # the parent asks a stuck rank where it is with SIGUSR1
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    def file(kind):
        return supervise.path(tmp, rank, kind)

    pulse = heartbeat.Heartbeat(heartbeat.MappedBeat(file("beat")), parent_pid).start()
    phase = "start"
    try:
        with open(os.path.join(tmp, "spec.pkl"), "rb") as f:
            spec = pickle.load(f)  # imports the module of the function to run
        world_size, backend = spec["world_size"], spec["backend"]
        if backend == "gloo":
            # Every rank shares the CPU: one intra-op thread each avoids oversubscribing small machines.
            torch.set_num_threads(1)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
        else:
            torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        timeout = datetime.timedelta(seconds=spec["timeout"] + preflight._GROUP_TIMEOUT_MARGIN_S)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        phase = pulse.phase = "run"
        result = spec["fn"](rank, world_size, *spec["args"], **spec["kwargs"])
        torch.save(result, file("tmp"))
        os.replace(file("tmp"), file("result"))  # atomic: the parent never reads half a file
        pulse.stop(done=True)
        leave_together(store, rank, world_size, timeout)
    except BaseException as exc:
        supervise.write_json(file("error"), {"time": time.time(), "type": type(exc).__name__, "phase": phase,
                                           "message": str(exc), "traceback": traceback.format_exc()})
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def leave_together(store, rank, world_size, timeout):
    """Wait, after the run, until every rank has finished its function: only then close this
    rank's sockets.

    gloo connects the ranks pair by pair (connectFullMesh), and a rank's connections are complete
    when its own ``init_process_group`` (or ``new_group``) returns, not its peers'. A fast rank that
    ran a function without a collective and exited could close its end of a pair that a slow,
    starved peer was still setting up; that peer's ``init_process_group`` then failed with "Gloo
    connectFullMesh failed ... Connection closed by peer" and the launch with it (seen under load
    average 7 to 40 on 2 cores; `python -m labs.launcher.under_load` reproduces it and checks the
    fix). A rank that got here has finished every group it was asked to join, so once all ranks
    have checked in through the store, no connection is still being made. The store, not a gloo
    barrier: no byte on the process group, and a function may have left its group unusable.
    """
    store.set(f"labs-finished/{rank}", "1")
    store.wait([f"labs-finished/{r}" for r in range(world_size)], timeout)  # the group's own timeout


# What the zygote imports before it forks: the libraries every rank needs, never the caller's code
# (a rank still imports the lab's own module afresh, as a fresh interpreter would).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "numpy")


def _say(record):
    import json
    os.write(1, (json.dumps(record) + "\n").encode())  # one short write: never interleaved, never buffered


def zygote(parent_pid):
    """Serve the launcher: one JSON line on stdin asks for a rank, one line on stdout answers with its
    PID, and another reports its exit code once it is reaped. End of stdin (the launcher closed it,
    or died) kills every rank still running and ends the zygote."""
    import importlib
    import json
    import select
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library: the rank imports what it needs itself
            pass
    _say({"ready": os.getpid()})
    children, buffer = set(), b""
    while True:
        if select.select([0], [], [], 0.05)[0]:
            data = os.read(0, 1 << 16)
            if not data:
                break
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                pid = _fork_rank(request["tmp"], request["rank"], request["cwd"], request["env"])
                children.add(pid)
                _say({"id": request["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _say({"pid": pid, "code": os.waitstatus_to_exitcode(status)})
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fork_rank(tmp, rank, cwd, env):
    """A rank forked from this zygote: what ``python labs/launcher/_rank.py TMP RANK PID`` would do, without
    paying for the imports again. Never returns in the child."""
    import warnings
    zygote_pid = os.getpid()
    with warnings.catch_warnings():
        # Python 3.12 warns on fork with any other thread alive; the only one here is BLAS's idle
        # pool, which registers its own fork handlers.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, "stdout",
                                                               os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            target = os.open(name if fd == 0 else os.path.join(tmp, f"rank{rank}.{name}"), flags, 0o644)
            os.dup2(target, fd)
            os.close(target)
        die_with_parent(zygote_pid)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)  # the caller's environment now, as a fresh interpreter would get it
        sys.argv = [os.path.abspath(__file__), tmp, str(rank), str(zygote_pid)]
        _set_path(tmp)
        run(tmp, rank, zygote_pid)
        code = 0
    except SystemExit as exc:  # what the interpreter would make of it
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _set_path(tmp):
    import json
    with open(os.path.join(tmp, "sys_path.json")) as f:
        sys.path[:] = json.load(f)  # the parent's: its labs/, and the module of the function to run


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        die_with_parent(int(sys.argv[2]))
        zygote(int(sys.argv[2]))
        sys.exit(0)
    tmp, rank, parent_pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    die_with_parent(parent_pid)
    _set_path(tmp)
    run(tmp, rank, parent_pid)
