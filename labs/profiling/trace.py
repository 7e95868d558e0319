"""Chapter 15: one `torch.profiler` trace per rank, written and read back.

    with trace.Recorder(folder, rank) as rec:
        for i in range(steps):
            with rec.step(i):
                train_step()
    rec.path, rec.steps          # folder/rank0.json.gz; each step's wall-clock seconds
    rec.threads                  # each step's CPU and run-queue seconds of this thread (kernel), and
                                 # of the process's other Python threads (``others_s``)

`Recorder` runs the profiler on this rank (CPU ops, and CUDA kernels on a GPU), with shapes and
memory recorded (``shapes=False``: no shapes, hence no bytes per collective and no peer or tag of a
point-to-point call, for a run that reads neither: less profiler work per operator), and marks each
step with a ``record_function`` named `STEP`; the step's wall-clock time is measured around the same
block (`labs.measure.timing.now`: the host clock, read after this process's queued GPU work is
done), and so is the thread's time on a CPU and waiting for one (the kernel's schedstat), so a trace
can be checked against the clock and the scheduler (`labs.profiling.analysis.coverage`). The trace
is Chrome's JSON format, gzipped (``gz=False``: plain, for a run's own temporary traces, saving the
compression): catapult's trace viewer (chrome://tracing) and Perfetto (ui.perfetto.dev) open either
as it is. The point-to-point spans overlap the thread's operators without nesting: older Perfetto
dropped them; since mid-2026 (google/perfetto #6284) it draws them on an overflow row.

`load` reads a trace back into plain dicts. What torch.profiler 2.13 records for gloo on the CPU,
read from real traces (the analysis is built on exactly this, `labs.profiling.analysis`):
- a collective called on the rank's thread shows there as ``c10d::allreduce_`` (``_allgather_base_``,
  ``_reduce_scatter_base_``, ``alltoall_base_``, ``barrier``...): the time to *issue* it, short
  when ``async_op=True``;
- the collective itself runs on one of gloo's own threads (``pt_gloo_runloop``) as
  ``gloo:all_reduce`` (``gloo:all_gather``, ``gloo:all_to_all``...; a reduce-scatter shows as
  ``gloo:all_reduce`` of the whole input, which gloo runs in its place): from
  the moment that thread takes it up until it is done;
- a point-to-point message shows on the rank's thread as ``c10d::send`` or ``c10d::recv_`` (with
  the peer and the tag among its recorded arguments) and a span ``gloo:send`` or ``gloo:recv`` from
  the moment it is posted until it is waited on (a receive's span too: gloo records no earlier
  completion, however early the data came), which other operators of that thread overlap;
- ``Work.wait()`` records nothing: a rank waiting on communication leaves a gap in its thread's
  operators while a gloo span is open. That gap, not any event, is the exposed communication.
"""
import gzip
import json
import os
import threading
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from labs.measure import timing

ARGS = ("gloo:", "nccl:", "c10d::")   # the events whose arguments `load` keeps (and "[memory]")
STEP = "labs:step"   # the record_function around each profiled step: "labs:step#3"


def _on_gpu():
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def thread_times(tid=None):
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread so far, or of this
    process's thread with native id ``tid``, from the kernel's schedstat; None where the kernel does not
    provide it (or the thread has ended)."""
    try:
        with open("/proc/thread-self/schedstat" if tid is None else f"/proc/self/task/{tid}/schedstat") as f:
            on_cpu, waiting = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def other_threads():
    """{native id: `thread_times`} of this process's Python threads other than the calling one (the
    launcher's heartbeat): the only threads that take the GIL, so the only ones a rank's thread can
    wait for without an event (gloo's and the profiler's threads are C++ and hold it only to run a Python
    callback, such as chapter 2's hand DDP attaches to each bucket)."""
    me = threading.get_ident()
    out = {}
    for t in threading.enumerate():
        times = thread_times(t.native_id) if t.ident != me and t.native_id is not None else None
        if times is not None:
            out[t.native_id] = times
    return out


def others_seconds(before, after):
    """Seconds the other Python threads spent on a CPU or runnable between two `other_threads`."""
    return sum(cpu + wait - sum(before.get(tid, (0.0, 0.0))) for tid, (cpu, wait) in after.items())


class Recorder:
    """torch.profiler around a block on this rank; the trace goes to ``folder/rank{rank}.json.gz``."""

    def __init__(self, folder, rank, memory=True, gz=True, shapes=True):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank{rank}.json" + (".gz" if gz else ""))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _on_gpu() else [])
        self.profiler = profile(activities=activities, record_shapes=shapes, profile_memory=memory)
        self.steps = []   # wall-clock seconds of each step, measured around its block
        # per step, the rank thread's {"cpu_s", "delay_s"} and the other Python threads' "others_s"
        # (kernel), or None
        self.threads = []

    def __enter__(self):
        timing.sync()
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        timing.sync()
        self.profiler.__exit__(*exc)
        if exc[0] is None:
            self.profiler.export_chrome_trace(self.path)
        return False

    @contextmanager
    def step(self, i):
        """One step: a `STEP` annotation in the trace, and its wall-clock time in ``self.steps``.
        On a GPU the step ends when its kernels have, not when the CPU has queued them."""
        timing.sync()
        o0, k0, t0 = other_threads(), thread_times(), timing.now()
        with record_function(f"{STEP}#{i}"):
            yield
            timing.sync()
        self.steps.append(timing.now() - t0)
        k1, o1 = thread_times(), other_threads()
        self.threads.append({"cpu_s": k1[0] - k0[0], "delay_s": k1[1] - k0[1],
                             "others_s": others_seconds(o0, o1)} if k0 and k1 else None)


def load(path):
    """A trace file (``.json`` or ``.json.gz``) as {"rank", "world_size", "events": [...]}.

    Only the events the analysis reads are kept: complete events ("X": an operator, an annotation,
    a gloo span, a GPU kernel) and the profiler's memory records ("i" named ``[memory]``), each as
    a dict with name, cat, tid, ts and dur in microseconds, and args: kept only where the analysis
    reads them (`ARGS`: the communication spans' shapes, the point-to-point calls' peer and tag,
    the memory records), empty for the operators, whose shapes make most of a trace's bytes.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        raw = json.load(f)
    info = raw.get("distributedInfo") or {}
    keep = [e for e in raw["traceEvents"]
            if e.get("ph") == "X" or (e.get("ph") == "i" and e.get("name") == "[memory]")]
    events = [{"name": e["name"], "cat": e.get("cat", ""), "tid": e.get("tid"), "ts": float(e["ts"]),
               "dur": float(e.get("dur", 0.0)), "ph": e["ph"],
               "args": e.get("args", {}) if e["ph"] == "i" or e["name"].startswith(ARGS) else {}}
              for e in keep]
    return {"rank": info.get("rank", 0), "world_size": info.get("world_size", 1),
            "backend": info.get("backend"), "events": events}


def load_folder(folder):
    """Every ``rank*.json[.gz]`` of a folder, in rank order."""
    names = sorted(n for n in os.listdir(folder) if n.startswith("rank") and ".json" in n)
    traces = [load(os.path.join(folder, n)) for n in names]
    return sorted(traces, key=lambda t: t["rank"])
