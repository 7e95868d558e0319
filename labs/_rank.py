"""The first code a spawned rank runs: ``python labs/_rank.py TMP RANK PARENT_PID`` (see labs.launch).

It imports nothing but the standard library until it has asked the kernel to kill it when its
parent dies and has checked that the parent is still there: a parent killed while its ranks were
still importing torch must not leave them running the job on their own.
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

    from labs import heartbeat, launch, supervise

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
        timeout = datetime.timedelta(seconds=spec["timeout"] + launch._GROUP_TIMEOUT_MARGIN_S)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        phase = pulse.phase = "run"
        result = spec["fn"](rank, world_size, *spec["args"], **spec["kwargs"])
        torch.save(result, file("tmp"))
        os.replace(file("tmp"), file("result"))  # atomic: the parent never reads half a file
        pulse.stop(done=True)
    except BaseException as exc:
        supervise.write_json(file("error"), {"time": time.time(), "type": type(exc).__name__, "phase": phase,
                                           "message": str(exc), "traceback": traceback.format_exc()})
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    tmp, rank, parent_pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    die_with_parent(parent_pid)
    import json
    with open(os.path.join(tmp, "sys_path.json")) as f:
        sys.path[:] = json.load(f)  # the parent's: its labs/, and the module of the function to run
    run(tmp, rank, parent_pid)
