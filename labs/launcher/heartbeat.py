"""Where each rank is, a few times a second: how the launcher names the rank that hung (see intro).

From outside, a rank blocked in a collective and the rank it waits for look alike: neither makes
progress. So every rank runs a thread that writes, every `PERIOD` seconds, a beat: where its main
thread is (the innermost frame of user code, and the collective it is inside, if any) and how many
operations it has entered on each process group (c10d's per-group sequence numbers). At the
timeout the launcher reads the last beat of each rank that did not finish and names the ranks the
others were waiting for: the ones outside any collective, silent, or behind their peers. Spawned
ranks write their beats into shared memory, torchrun ranks through torchrun's store.
"""
import json
import linecache
import mmap
import os
import re
import sys
import threading
import time

import torch
import torch.distributed as dist

PERIOD = 0.25
STALE_S = 3.0  # a rank silent this long is not running Python at all (stopped, or holding the GIL)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# What a rank raises when a peer, not its own code, failed: the peer is the one to name.
SYMPTOMS = re.compile(r"Connection (reset|closed) by peer|Broken pipe|connection closed|Socket Timeout|"
                      r"Timed out waiting|timed out|NCCL communicator was aborted|Read error|"
                      r"remote process exited|ECONNRESET|EPIPE", re.IGNORECASE)
_COLLECTIVE_DIRS = tuple(os.path.join(_TORCH_DIR, d) + os.sep for d in ("distributed", os.path.join("nn",
                                                                                                    "parallel")))


def where(frame):
    """(user code location, collective or None) of a frame stack, innermost first."""
    collective, library = None, []
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        library.append(frame)
        frame = frame.f_back
    for f in library:  # the c10d entry point (all_reduce, barrier, ...) names the collective
        if f.f_code.co_filename.startswith(_COLLECTIVE_DIRS):
            collective = f.f_code.co_name
            if f.f_code.co_filename.endswith("distributed_c10d.py"):
                break
    if frame is None:
        return "no Python frame", collective
    code = frame.f_code
    here = f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
    if collective is None and not library and ".wait(" in linecache.getline(code.co_filename, frame.f_lineno):
        collective = "wait"  # blocked on the handle of an asynchronous send, recv or collective
    return here, collective


def sequence_numbers():
    """Operations this rank has entered on each of its process groups, by group name."""
    if not dist.is_available() or not dist.is_initialized():
        return {}
    out = {}
    for pg, name in list(getattr(dist.distributed_c10d._world, "pg_names", {}).items()):
        try:
            out[str(name)] = int(pg._get_sequence_number_for_group())
        except Exception:  # a backend without sequence numbers: the frame alone will have to do
            pass
    return out


def beat(phase="run", done=False):
    main = sys._current_frames().get(threading.main_thread().ident)
    here, collective = where(main)
    return {"time": time.time(), "phase": phase, "where": here, "collective": collective,
            "seq": sequence_numbers(), "done": done}


class Heartbeat:
    """A daemon thread calling ``write(beat())`` every ``period`` seconds (None: only at start and
    stop); with ``parent_pid`` it also ends the rank if that process is gone (where the kernel's
    parent-death signal does not exist).

    ``write`` must not make a system call that writes: chapter 2 measures the library's wire bytes
    as the growth of this process's written bytes (`labs.measure.wire`), and a beat written inside that
    window would be counted as traffic. `MappedBeat` writes into shared memory instead.
    """

    def __init__(self, write, parent_pid=None, period=PERIOD):
        self.write, self.parent_pid, self.period = write, parent_pid, period
        self.phase = "start"  # the rank sets "run" once it has joined the group
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="labs-heartbeat", daemon=True)

    def start(self):
        if self.period is None:
            self._safe_write()
        else:
            self._thread.start()
        return self

    def stop(self, done=False):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._safe_write(done)

    def _safe_write(self, done=False):
        try:
            self.write(beat(self.phase, done))
        except Exception:  # a beat that cannot be written is a missing beat, not a crash
            pass

    def _run(self):
        while True:
            self._safe_write()
            if self._stop.wait(self.period):
                return
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                os._exit(1)


class MappedBeat:
    """A beat file the rank writes through shared memory (no write system call, so no byte of it
    is counted by /proc/self/io) and the launcher reads as an ordinary file."""

    SIZE = 8192

    def __init__(self, path):
        with open(path, "w+b") as f:
            f.truncate(self.SIZE)
            self.map = mmap.mmap(f.fileno(), self.SIZE)

    def __call__(self, beat):
        data = json.dumps(beat).encode()
        if len(data) < self.SIZE:
            self.map[:] = data + bytes(self.SIZE - len(data))


def read_beat(path, tries=3):
    """The last beat in a MappedBeat file, or None; a read that met a write half-done is retried."""
    for _ in range(tries):
        try:
            with open(path, "rb") as f:
                data = f.read().rstrip(b"\0")
            return json.loads(data) if data else None
        except OSError:
            return None
        except ValueError:
            time.sleep(0.01)
    return None


def verdict(beats, unfinished, now, stale_s=STALE_S):
    """Split the ranks that did not finish into the ones the others waited for and the waiters.

    Returns (culprits: {rank: reason}, waiters: {rank: collective}). A rank is a culprit when it is
    outside any collective, silent for ``stale_s``, or, if every rank is inside one, when it entered
    fewer operations on a group than a peer did: it never reached the collective the others are in.
    """
    culprits, waiters = {}, {}
    for r in unfinished:
        b = beats.get(r)
        if b is None:
            culprits[r] = "it had not started (no heartbeat: still importing torch, or stuck before)"
        elif b.get("phase") == "start":
            culprits[r] = f"it was still starting, in {b['where']} (joining the process group)"
        elif now - b["time"] > stale_s:
            culprits[r] = (f"it stopped running Python {now - b['time']:.0f} s before the timeout, "
                           f"in {b['where']}")
        elif b["collective"] is None:
            culprits[r] = f"it was in {b['where']}, outside any collective"
        else:
            waiters[r] = b["collective"]
    if culprits or not waiters:
        return culprits, waiters
    for group in set.intersection(*(set(beats[r]["seq"]) for r in waiters)):
        counts = {r: beats[r]["seq"][group] for r in waiters}
        top = max(counts.values())
        for r, n in counts.items():
            if n < top:
                culprits[r] = (f"it entered {n} operations on process group {group}, its peers {top}: it "
                               f"never reached the collective they wait in (it waits in {waiters[r]})")
    return culprits, {r: c for r, c in waiters.items() if r not in culprits}


def is_symptom(message):
    """An error a rank raises because a peer failed (its connection dropped, a collective timed out)."""
    return bool(SYMPTOMS.search(message or ""))


def timeout_message(beats, unfinished, world_size, timeout, now, stale_s=STALE_S):
    culprits, waiters = verdict(beats, unfinished, now, stale_s)
    lines = [f"rank {r} of {world_size} did not finish within {timeout:g} s: {why}" for r,
             why in sorted(culprits.items())]
    if all((beats.get(r) or {}).get("phase", "start") == "start" for r in unfinished):
        lines.append(f"(starting a rank imports torch and joins the group: about a second per rank on a "
                     f"small machine, more under load; raise the timeout above {timeout:g} s)")
    if waiters and culprits:
        ranks = ", ".join(str(r) for r in sorted(waiters))
        where = ", ".join(sorted(set(waiters.values())))
        lines.append(f"(rank{'s' if len(waiters) > 1 else ''} {ranks} waited for it in {where})")
    elif waiters:
        stuck = ", ".join(f"{r} in {c}" for r, c in sorted(waiters.items()))
        lines.append(f"ranks {stuck} of {world_size} did not finish within {timeout:g} s, each waiting in a "
                     "collective with the same number of operations entered: a deadlock (e.g. ranks "
                     "calling different collectives, or a recv without its send)")
    return "\n".join(lines) + "; all ranks were stopped."
