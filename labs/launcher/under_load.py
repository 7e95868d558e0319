"""Many launches in a row on a machine whose cores are all busy: the launcher's start-up under load.

    python -m labs.launcher.under_load --launches 50 --world-size 4 --busy 8

starts ``--busy`` processes that spin on the CPU (a load average of about ``--busy`` plus
whatever else runs), then launches ``--launches`` runs of ``--world-size`` ranks one after the
other, each from a new zygote (`labs.launcher.zygote`), as the first launch of a notebook or a
test is, and counts the launches that failed. Each run's function returns at once, without a
collective: the case in which a fast rank leaves while a starved peer is still connecting.

Two start-up failures showed under a load average of 7 to 40 on 2 cores, and both are fixed in
the launcher: a new zygote's import of torch counted against the run's timeout, so the first
launch timed out before any rank existed (`zygote.wait_ready`); and a rank that had finished could
close its gloo connections while a slow peer was still making its own, which failed the peer's
``init_process_group`` with "Gloo connectFullMesh failed ... Connection closed by peer"
(`labs.launcher._rank.leave_together`). A benchmark, not a test: it takes minutes, and `make test`
does not run it.
"""
import os
import statistics
import subprocess
import sys
import time

from labs.launcher import cli, launch, zygote

# A spinning process that dies with us (parent-death signal), so no busy loop outlives the bench.
_SPIN = ("import ctypes, signal, sys\n"
         "if sys.platform.startswith('linux'): ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
         "while True: pass\n")


def finish_at_once(rank, world_size):
    """The run: nothing after joining the group (no collective holds the fast ranks back)."""
    return os.getpid()


def spin(n):
    return [subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]


def stop(procs):
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def under_load(launches=50, world_size=4, busy=8, timeout=120.0, fresh=True):
    """``launches`` launches of ``world_size`` ranks while ``busy`` processes spin; failures counted."""
    if busy < 0:
        raise ValueError(f"--busy {busy}: the number of spinning processes cannot be negative.")
    spinners, rows = spin(busy), []
    try:
        start = time.monotonic()
        for i in range(launches):
            if fresh:
                zygote.retire()  # the next launch starts a new zygote, as a first launch does
            t0 = time.monotonic()
            try:
                pids = launch.spawn(finish_at_once, world_size, timeout=timeout)
                error = None
            except launch.RankError as exc:
                pids, error = [], str(exc).splitlines()[0][:200]
            rows.append({"launch": i, "ok": error is None, "seconds": time.monotonic() - t0,
                         "load1": os.getloadavg()[0], "error": error, "pids": pids})
        seconds = time.monotonic() - start
    finally:
        stop(spinners)
    loads = [r["load1"] for r in rows]
    return {"launches": launches, "world_size": world_size, "busy": busy, "cores": os.cpu_count(),
            "fresh_zygote": fresh, "failures": sum(not r["ok"] for r in rows),
            "errors": [r["error"] for r in rows if r["error"]], "seconds": seconds,
            "median_launch_s": statistics.median(r["seconds"] for r in rows) if rows else None,
            "load1_min": min(loads, default=None), "load1_max": max(loads, default=None),
            "spinner_pids": [p.pid for p in spinners], "rows": rows}


def main(argv=None):
    p = cli.parser("Launch N runs in a row while other processes keep every core busy; count the "
                   "failed launches.", world_size_default=4)
    p.add_argument("--launches", type=cli.at_most(1000, "a bench, not a soak test"), default=50)
    p.add_argument("--busy", type=int, default=8, help="spinning processes started (default 8)")
    p.add_argument("--warm", action="store_true",
                   help="reuse one zygote for every launch (default: a new one per launch)")
    args = cli.parse(p, argv)
    r = under_load(args.launches, args.world_size, args.busy, args.timeout, fresh=not args.warm)
    cli.report({k: v for k, v in r.items() if k != "rows"}, args,
               f"{r['failures']} of {r['launches']} launches of {r['world_size']} ranks failed, with "
               f"{r['busy']} spinning processes on {r['cores']} cores (load average "
               f"{r['load1_min']:.1f} to {r['load1_max']:.1f}); {r['seconds']:.0f} s in all, "
               f"median launch {r['median_launch_s']:.1f} s")


if __name__ == "__main__":
    from labs.launcher import under_load as imported
    cli.main(imported.main)
