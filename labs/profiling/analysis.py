"""Chapter 15: where a step's time goes, computed from the events of each rank's trace.

Per rank and per step (the `trace.STEP` annotation's window), on the CPU with gloo
(`labs.profiling.trace` says which events exist):

- compute: the union of the rank thread's ``aten::`` operators, minus any communication call
  made inside one. Only ATen operators count: a wrapper (an autograd node, a module hook) can hold
  a ``Work.wait()``, which records nothing, and counting the wrapper would call that wait compute.
- communication in flight ("issued"): issued and not yet complete: the union of every gloo span
  (on gloo's threads, or a point-to-point message from post to completion), of the ``c10d::``
  issue calls on the rank thread, and of the rank's waits below (a collective gloo's thread has not
  yet taken up is queued, still in flight), minus the peer wait below.
- exposed communication: the time the rank thread computes nothing and waits on communication. A
  wait records nothing, but it returns when the communication completes: so, the issue calls, and
  each gap between the rank thread's operators from its start up to the last completion inside it
  (`waited`). It is part of the communication in flight by construction. A gap that no completion
  ends is the interpreter or the scheduler, not a wait. (Holistic Trace Analysis's definition for
  GPU kernels, communication time not overlapped by compute kernels, is what `_gpu_breakdown` uses.)
- peer wait: the part of a receive before its peer had even posted the matching send (the send
  is found in the peer's trace by source, destination and tag, in order), and the part of a send
  before its peer had posted the matching receive, where the sender is not computing (gloo's wait
  on an isend blocks until the receiver posts): the rank waits for the peer's compute, not for the
  wire. In a pipeline this is the bubble.
- input: the time spent in the data loader's ``__next__`` (its ``enumerate(DataLoader)#...``
  annotation) while neither computing nor waiting on communication: the step stalled on its input.
- idle: the rest of the step: the interpreter between operators, and the scheduler's time.
- overlap fraction: the share of the communication in flight that ran under compute.

compute + exposed + peer wait + input + idle = the step, exactly, by construction. On a GPU trace the
same quantities come from kernels: compute kernels, NCCL kernels (``nccl`` in the name), and the
step's window on the GPU timeline (its ``gpu_user_annotation``), as HTA computes them.
"""
import bisect
import sys
from collections import defaultdict

from labs.profiling import intervals as iv
from labs.profiling.trace import STEP

ISSUE = "c10d::"                      # a collective or point-to-point call, issued on the rank thread
SPANS = ("gloo:", "nccl:")            # the communication itself (gloo's threads; p2p from post to done)
KERNELS = ("kernel", "gpu_memcpy", "gpu_memset")
LOADER = "enumerate(DataLoader)#"     # torch.utils.data's annotation around each batch it hands over
ELEMENT_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
                 "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
                 "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}


def steps(events):
    """[(index, start, end)] of the `STEP` annotations, in order, and the thread they are on."""
    found = [(int(e["name"].split("#")[1]), e["ts"], e["ts"] + e["dur"], e["tid"]) for e in events
             if e["ph"] == "X" and e["name"].startswith(STEP + "#") and e["cat"] != "gpu_user_annotation"]
    if not found:
        raise ValueError(f"the trace has no '{STEP}#i' annotation: record it with trace.Recorder.step.")
    found.sort(key=lambda s: s[1])
    return [s[:3] for s in found], found[0][3]


P2P = ("gloo:send", "gloo:recv")


def _spans(events, tid):
    """Collective communication in flight: gloo spans anywhere, issue calls on the rank thread."""
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["name"] not in P2P and
            (e["name"].startswith(SPANS) or (e["tid"] == tid and e["name"].startswith(ISSUE)))]


def messages(trace):
    """Point-to-point calls of the rank thread: {"kind", "peer", "tag", "post", "span"}, in order.
    The peer is the rank within the call's group, as recorded in the call's arguments."""
    events = trace["events"]
    _, tid = steps(events)
    spans = sorted((e for e in events if e["tid"] == tid and e["name"] in P2P), key=lambda e: e["ts"])
    out = []
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["tid"] != tid or e["name"] not in ("c10d::send", "c10d::recv_"):
            continue
        args = e["args"].get("Concrete Inputs") or []
        kind = "send" if e["name"] == "c10d::send" else "recv"
        span = next((s for s in spans
                     if s["name"] == "gloo:" + kind and e["ts"] <= s["ts"] <= e["ts"] + e["dur"]), None)
        out.append({"kind": kind, "peer": int(args[2]) if len(args) > 3 else None,
                    "tag": int(args[3]) if len(args) > 3 else None, "post": e["ts"],
                    "span": (span["ts"], span["ts"] + span["dur"]) if span
                    else (e["ts"], e["ts"] + e["dur"])})
    return out


def point_to_point(traces):
    """Per rank, its messages split by what the other end was doing (one run's traces, rank order, one
    clock), matched by (source, destination, tag) in order. A receive posted before its peer's send
    waits ("wait"), then transfers ("transfer") until it is waited on (its gloo span's end). A send is
    in flight from the later post until its receive's span ends; before, it pends ("send_pending":
    post, receive's post, completion; `breakdown` books a wait only where the rank waits on it). An
    unmatched message is all transfer: the peer torch records is the rank within the group, read as
    the global rank, so a subgroup not of ranks 0, 1, ... (the 3D lab's TP ring) goes unmatched."""
    msgs = [messages(t) for t in traces]
    posted = {"send": defaultdict(list), "recv": defaultdict(list)}    # (src, dst, tag) -> [(post, end)]
    for rank, ms in enumerate(msgs):
        for m in ms:
            posted[m["kind"]][_key(rank, m)].append((m["post"], m["span"][1]))
    out = []
    for rank, ms in enumerate(msgs):
        seen, parts, pending = defaultdict(int), {"transfer": [], "wait": []}, []
        for m in ms:
            key = _key(rank, m)
            other = posted["recv" if m["kind"] == "send" else "send"][key]
            n = seen[m["kind"], key]
            seen[m["kind"], key] += 1
            a, b = m["span"]
            if n >= len(other):
                parts["transfer"].append((a, b))
                continue
            start = min(max(a, other[n][0]), b)
            if m["kind"] == "recv":
                parts["wait"].append((a, start))
                parts["transfer"].append((start, b))
            else:                  # in flight until the receive's span ends; pending before its post
                end = min(b, max(start, other[n][1]))
                parts["transfer"].append((start, end))
                pending += [(a, start, end)] if start > a else []
        out.append({**{k: iv.union(v) for k, v in parts.items()}, "send_pending": pending})
    return out


def _key(rank, m):
    """(source, destination, tag) of a message seen from ``rank``."""
    return (rank, m["peer"], m["tag"]) if m["kind"] == "send" else (m["peer"], rank, m["tag"])


def _gpu(events):
    return any(e["cat"] in KERNELS for e in events)


def breakdown(trace, p2p=None):
    """Per step of one rank's trace: seconds of compute, communication in flight, exposed
    communication, peer wait and idle, and the overlap fraction (see the module docstring).
    ``p2p``: this rank's entry of `point_to_point`; without it a message's whole span is transfer."""
    events = trace["events"]
    windows, tid = steps(events)
    if _gpu(events):
        return _gpu_breakdown(events, windows)
    if p2p is None:
        p2p = {"transfer": iv.union((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] in P2P),
               "wait": []}
    compute_all = iv.union((e["ts"], e["ts"] + e["dur"]) for e in events
                           if e["tid"] == tid and e["cat"] == "cpu_op" and e["name"].startswith("aten::"))
    issue = iv.union((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e["tid"] == tid and e["name"].startswith(ISSUE))
    compute_all = iv.subtract(compute_all, issue)
    spans = _spans(events, tid)
    comm_all = iv.union(spans + p2p["transfer"])
    ends = [e["ts"] + e["dur"] for e in events if e["name"].startswith(SPANS) and e["name"] not in P2P]
    ends += [b for _, b in p2p["transfer"]]              # a collective's, or a message's, completion
    waits = iv.union(p2p["wait"] + _send_waits(compute_all, issue, p2p))   # merged: no stretch twice
    waits = iv.subtract(iv.subtract(waits, compute_all), issue)
    exposed_all = iv.subtract(waited(compute_all, issue, comm_all, ends), waits)
    comm_all = iv.union(comm_all + exposed_all)          # a queued collective waited for is in flight
    loader = iv.union((e["ts"], e["ts"] + e["dur"]) for e in events
                      if e["tid"] == tid and e["name"].startswith(LOADER))
    loader = iv.subtract(iv.subtract(loader, iv.union(compute_all + exposed_all)), waits)
    parts = (compute_all, comm_all, waits, loader, exposed_all)
    return [_terms(i, (a, b), *(iv.clip(x, (a, b)) for x in parts)) for i, a, b in windows]


def _send_waits(compute, issue, p2p):
    """The part of each pending send (posted before its receive) inside the gap between the rank's
    operators that its completion ends: there the rank waits on the send, and so on its peer."""
    busy = iv.union(compute + issue)
    out = []
    for a, start, end in p2p.get("send_pending", ()):
        before = [b for _, b in busy if b <= end]
        g0 = max(before, default=a)                 # the gap ending at the completion starts here
        if not any(x < end and y > g0 for x, y in busy) and g0 < start:
            out.append((max(a, g0), start))
    return out


def waited(compute, issue, comm, ends):
    """The time the rank thread waited on communication: its issue calls, and each gap between its
    operators from its start up to the last completion (an end in ``ends``) inside it. A wait
    returns when a communication completes, and it may begin before gloo's thread has even taken
    the collective up (the queue shows as a gap with nothing in flight yet). A gap that no
    completion ends is the interpreter's or the scheduler's time, not a wait. No event records a
    wait, so a gap in which a collective merely completed counts too: this overstates the exposed
    time, most where collectives overlap compute and complete in its small gaps; a wake-up later
    than the completion it waited for is cut off at that completion, which understates it."""
    busy = iv.union(compute + issue)
    bounds = busy + comm
    if not bounds:
        return []
    gaps = iv.subtract([(min(a for a, _ in bounds), max(b for _, b in bounds))], busy)
    ends = sorted(ends)
    out = list(issue)
    for g0, g1 in gaps:
        k = bisect.bisect_right(ends, g1) - 1
        if k >= 0 and ends[k] > g0:
            out.append((g0, ends[k]))
    return iv.union(out)


def _terms(i, window, compute, comm, waits, loader=(), exposed=None):
    exposed = iv.subtract(comm, compute) if exposed is None else exposed
    step = window[1] - window[0]
    busy = iv.length(iv.union(compute + exposed + waits + list(loader)))
    comm_s = iv.length(comm)
    return {"step": i, "step_s": step / 1e6, "compute_s": iv.length(compute) / 1e6, "comm_s": comm_s / 1e6,
            "exposed_comm_s": iv.length(exposed) / 1e6, "peer_wait_s": iv.length(waits) / 1e6,
            "input_s": iv.length(loader) / 1e6, "idle_s": (step - busy) / 1e6,
            "overlap_fraction": iv.length(iv.intersect(comm, compute)) / comm_s if comm_s else None,
            "start_us": window[0], "intervals": {"compute": compute, "comm": comm, "exposed": exposed,
                                                 "peer_wait": waits, "input": list(loader)}}


def _gpu_breakdown(events, windows):
    """The same terms on the GPU timeline: kernels instead of the rank thread's operators."""
    gpu_windows = {int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in events
                   if e["cat"] == "gpu_user_annotation" and e["name"].startswith(STEP + "#")}
    kernels = [e for e in events if e["cat"] in KERNELS]
    comm = iv.union((e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower())
    # compute is every non-NCCL kernel, not the copies and sets (HTA 0.5.0's get_kernel_type files
    # those as memory): the exposed communication, NCCL time not under any compute kernel, is then
    # comm minus compute, as HTA's comm/comp overlap counts it
    compute = iv.union((e["ts"], e["ts"] + e["dur"]) for e in kernels
                       if e["cat"] == "kernel" and "nccl" not in e["name"].lower())
    out = []
    for i, a, b in windows:
        w = gpu_windows.get(i, (a, b))
        out.append(_terms(i, w, iv.clip(compute, w), iv.clip(comm, w), []))
    return out


def analyze(traces):
    """`breakdown` of every rank of one run (rank order), point-to-point peer waits matched
    across the ranks. Returns one list of per-step dicts per rank."""
    if any(_gpu(t["events"]) for t in traces):
        return [breakdown(t) for t in traces]
    return [breakdown(t, parts) for t, parts in zip(traces, point_to_point(traces))]


def totals(per_step, skip=0):
    """Sum of each term over the steps after the first ``skip``; overlap over the summed times."""
    rows = per_step[skip:]
    keys = ("step_s", "compute_s", "comm_s", "exposed_comm_s", "peer_wait_s", "input_s", "idle_s")
    out = {k: sum(r[k] for r in rows) for k in keys}
    hidden = sum(r["comm_s"] * (r["overlap_fraction"] or 0.0) for r in rows)
    out["overlap_fraction"] = hidden / out["comm_s"] if out["comm_s"] else None
    out["steps"] = len(rows)
    return out


def comm_by_op(trace, per_step=True):
    """Per communication span name (``gloo:all_reduce``...), over the spans that start inside a
    step window: calls, seconds in flight (union) and the bytes of the tensors the spans record
    (shape x element size, read from the trace); divided by the number of steps with ``per_step``."""
    windows, _ = steps(trace["events"])
    out = {}
    for e in trace["events"]:
        if e["ph"] != "X" or not e["name"].startswith(SPANS) or \
                not any(a <= e["ts"] < b for _, a, b in windows):
            continue
        row = out.setdefault(e["name"], {"calls": 0, "bytes": 0, "intervals": []})
        row["calls"] += 1
        row["intervals"].append((e["ts"], e["ts"] + e["dur"]))
        dims, types = e["args"].get("Input Dims") or [], e["args"].get("Input type") or []
        for shape, dtype in zip(dims, types):
            if isinstance(shape, list) and all(isinstance(n, int) for n in shape) and dtype in ELEMENT_BYTES:
                numel = 1
                for n in shape:
                    numel *= n
                row["bytes"] += numel * ELEMENT_BYTES[dtype]
    n = len(windows) if per_step else 1
    for row in out.values():
        row["seconds"] = iv.length(iv.union(row.pop("intervals"))) / 1e6 / n
        row["calls"] /= n
        row["bytes"] /= n
    return dict(sorted(out.items()))


def memory_timeline(trace, device_type=0):
    """[(seconds since the first record, bytes)] from the profiler's memory records: on the CPU
    (device type 0) the net bytes allocated since the profiler started, on a GPU (1) the total."""
    recs = sorted((e["ts"], e["args"].get("Total Allocated", 0)) for e in trace["events"]
                  if e["ph"] == "i" and e["args"].get("Device Type", 0) == device_type)
    if not recs:
        return []
    t0 = recs[0][0]
    return [((t - t0) / 1e6, b) for t, b in recs]


def coverage(row, wall_s, thread):
    """Does the trace account for a measured step? For one step of one rank: its trace terms
    (a `breakdown` row), its wall-clock seconds, and its thread's kernel times (`trace.thread_times`).

    The thread's wall time is on a CPU, runnable but waiting for one (delay D), or blocked. Idle
    time is outside every operator and every wait the trace shows. If the thread is never blocked there
    but on Python's GIL, idle is interpreter time (on a CPU, at most the CPU time not spent in
    operators), plus delay, plus the time another Python thread of the process held the GIL, which it
    can only do on a CPU or runnable (O, `trace.other_threads`: the launcher's heartbeat; gloo's and
    the profiler's threads are C++ and take it only to run a Python callback, such as chapter 2's hand
    DDP attaches to each bucket, a time this bound misses); operators, which do not block on the CPU, hold
    at most their own CPU time plus the delay inside them. The delays inside and outside operators
    add up to at most D, so

        idle <= (cpu - compute) + D + O + s.

    s, the stated margin: one hand-off of the GIL (``sys.getswitchinterval()``, 5 ms), how long a
    thread that wants it back can wait before the holder is made to let go. A wait the trace missed
    (blocked on something no event records) breaks the bound by its length, less the margin and the
    slack (CPU time spent while communication was in flight). ``window_s``: the trace's step window
    minus the wall clock's, the cost of entering and leaving the annotation.
    """
    out = {"step_s": wall_s, "window_s": row["step_s"] - wall_s, "idle_s": row["idle_s"],
           "covered_s": row["compute_s"] + row["exposed_comm_s"] + row["peer_wait_s"] + row["input_s"]}
    if thread is None:
        return dict(out, bound_s=None, holds=None, why="the kernel gives no per-thread schedstat here")
    others = thread.get("others_s", 0.0)
    bound = thread["cpu_s"] - row["compute_s"] + thread["delay_s"] + others + sys.getswitchinterval()
    return dict(out, bound_s=bound, cpu_s=thread["cpu_s"], delay_s=thread["delay_s"], others_s=others,
                margin_s=sys.getswitchinterval(), holds=row["idle_s"] <= bound)
