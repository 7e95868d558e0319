"""Memory over time on the CPU, in the snapshot format of PyTorch's memory viewer (every chapter).

On a GPU, practitioners record the caching allocator's history and dump it:

    torch.cuda.memory._record_memory_history(max_entries=100_000)
    train_step()
    torch.cuda.memory._dump_snapshot("snapshot.pickle")   # read with PyTorch's memory viewer

The file is a dict: ``segments`` (what the allocator holds when the snapshot is taken: each
segment's ``device``, ``address``, ``total_size``, ``stream`` and its ``blocks``, each with
``size``, ``requested_size``, ``state``, ``frames``) and ``device_traces`` (one list per device of
events, each with ``action`` (``segment_alloc``, ``alloc``, ``free_requested``,
``free_completed``, ``segment_free``), ``addr``, ``size``, ``stream``, ``time_us`` and ``frames``
(``name``, ``filename``, ``line``). The viewer replays the events backwards from the segments to
draw the live bytes after each event (its "Active Memory Timeline").

On the CPU there is no caching allocator to ask, so `Recorder` writes the same format from the
book's own storage accounting (`labs.measure.memory.PeakMemory`): every storage an ATen operator
makes is one block in its own segment, allocated when the operator returns it and freed when
Python frees it, and the frame is the operator that made it. The snapshot's peak (`replay_peak`,
the viewer's replay done in Python) is the accounting's ``peak_bytes`` to the byte, and `lost`
checks more than the peak: the event count (2 per allocation, 3 per free) and the whole replayed
curve against the accounting's own running totals, so a file that drops a short-lived block fails.

    with memory_snapshot.Recorder(model, optimizer) as rec:
        loss = model(x, y); loss.backward(); optimizer.step()
    rec.snapshot()                 # {"segments": [...], "device_traces": [[...]]}
    rec.dump("snapshot.pickle")    # the file `_dump_snapshot` would write
    replay_peak(rec.snapshot()) == rec.peak_bytes
    lost(rec.snapshot(), rec) == []   # what the file lost against the accounting: nothing

Addresses are the recorder's own (one counter, never reused), not the machine's: the viewer needs
them only to pair an allocation with its free. No allocator rounding, no cache of freed blocks:
the CPU's live bytes, not a GPU's reserved bytes.
"""
import itertools
import pickle
import time

from labs.measure.memory import PeakMemory

ALIGN = 512   # the addresses step by this much, as the CUDA allocator's blocks do


class Recorder(PeakMemory):
    """`PeakMemory` that also writes every allocation and free as a snapshot event."""

    def __init__(self, *external):
        super().__init__(*external)
        self.events = []
        self.addr = {}              # storage key -> (address, bytes, frames)
        self._next = itertools.count(1)
        self._segments = None
        self.totals = []            # PeakMemory's live bytes after each change it made, in order
        self.allocations = self.frees = 0   # the changes the accounting saw, by kind

    def _change(self, delta):
        super()._change(delta)
        if delta:
            self.totals.append(self.baseline_bytes + self.net)

    def _frames(self, baseline):
        name = "(held when recording started)" if baseline else (self._op or "?")
        return [{"name": name, "filename": "aten" if not baseline else "baseline", "line": 0}]

    def _event(self, action, addr, size, frames):
        self.events.append({"action": action, "addr": addr, "size": size, "stream": 0,
                            "time_us": time.perf_counter_ns() // 1000, "frames": frames})

    def _alloc(self, key, nbytes, baseline):
        addr = next(self._next) * ALIGN * 2 ** 20
        frames = self._frames(baseline)
        self.addr[key] = (addr, nbytes, frames)
        if not baseline:
            self._event("segment_alloc", addr, nbytes, frames)
            self._event("alloc", addr, nbytes, frames)

    def _free(self, key):
        addr, nbytes, frames = self.addr.pop(key)
        self._event("free_requested", addr, nbytes, frames)
        self._event("free_completed", addr, nbytes, frames)
        self._event("segment_free", addr, nbytes, frames)

    # -- PeakMemory's bookkeeping, each change written as events --------------------------------
    def _track(self, storage, baseline):
        key = storage._cdata
        known = key in self.live
        super()._track(storage, baseline)
        if not known and (self._active or baseline):
            self.allocations += not baseline
            self._alloc(key, storage.nbytes(), baseline)

    def _freed(self, key):
        if self._active and key in self.live and key in self.addr:
            self.frees += 1
            self._free(key)
        super()._freed(key)

    def _resized(self, storage):
        key = storage._cdata
        entry = self.live.get(key)
        if entry is not None and key in self.addr and storage.nbytes() != entry[1]:
            self._free(key)                       # a resize: the old block goes, a new one comes
            self.frees += 1
            if storage.nbytes():
                self.totals.append(self.baseline_bytes + self.net - entry[1])   # between the two
                self.allocations += 1
                self._alloc(key, storage.nbytes(), baseline=False)
        super()._resized(storage)

    def __exit__(self, *exc):
        self._segments = [_segment(addr, nbytes, frames) for addr, nbytes, frames in self.addr.values()
                          if nbytes]
        self._segments.sort(key=lambda s: s["address"])
        return super().__exit__(*exc)

    # -- results -------------------------------------------------------------------------------
    def snapshot(self):
        """The dict `torch.cuda.memory._dump_snapshot` writes, for one device (index 0)."""
        if self._segments is None:
            raise RuntimeError("the snapshot is taken when the block ends")
        return {"segments": self._segments, "device_traces": [list(self.events)]}

    def dump(self, path):
        """The snapshot as a pickle, like ``_dump_snapshot(path)``; the viewer opens it as it is."""
        with open(path, "wb") as f:
            pickle.dump(self.snapshot(), f)
        return path


def _segment(addr, nbytes, frames):
    block = {"address": addr, "size": nbytes, "requested_size": nbytes, "state": "active_allocated",
             "frames": frames}
    return {"device": 0, "address": addr, "total_size": nbytes, "allocated_size": nbytes,
            "active_size": nbytes, "requested_size": nbytes, "stream": 0, "segment_type": "large",
            "blocks": [block]}


def replay(snapshot, device=0):
    """Live bytes before the first event and after each one, as the memory viewer replays them:
    the blocks held at the start are those freed without being allocated in the trace, and those
    still held at the end that the trace never allocated."""
    events = snapshot["device_traces"][device]
    allocated = set()
    start = 0
    for e in events:
        if e["action"] == "alloc":
            allocated.add(e["addr"])
        elif e["action"] in ("free_completed", "free") and e["addr"] not in allocated:
            start += e["size"]
    for seg in snapshot["segments"]:
        if seg["device"] == device:
            start += sum(b["requested_size"] for b in seg["blocks"]
                         if b["state"] == "active_allocated" and b["address"] not in allocated)
    live, out = start, [start]
    for e in events:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] in ("free_completed", "free"):
            live -= e["size"]
        else:
            continue
        out.append(live)
    return out


def _steps(curve):
    """The curve without repeated neighbours (a zero-byte block moves nothing)."""
    return [x for i, x in enumerate(curve) if i == 0 or x != curve[i - 1]]


def lost(snapshot, recorder, device=0):
    """What the file lost against the `Recorder` that wrote it, one sentence per difference; [] when
    nothing. Checked: the number of events (2 per allocation, 3 per free the accounting counted),
    and the whole replayed curve against the accounting's running totals, start, end and peak
    included. A file that drops a block alive only between two other events keeps its start, end
    and peak, and fails here."""
    events = snapshot["device_traces"][device]
    out = []
    want = 2 * recorder.allocations + 3 * recorder.frees
    if len(events) != want:
        out.append(f"{len(events)} events, not 2 x {recorder.allocations} allocations "
                   f"+ 3 x {recorder.frees} frees = {want}.")
    live = replay(snapshot, device)
    ends = (live[0], live[-1], max(live))
    if ends != (recorder.baseline_bytes, recorder.end_bytes, recorder.peak_bytes):
        out.append(f"start, end, peak {ends} are not the accounting's "
                   f"{(recorder.baseline_bytes, recorder.end_bytes, recorder.peak_bytes)}.")
    curve, totals = _steps(live), _steps([recorder.baseline_bytes] + recorder.totals)
    if curve != totals:
        first = next((i for i, (a, b) in enumerate(zip(curve, totals)) if a != b),
                     min(len(curve), len(totals)))
        out.append(f"the replayed curve ({len(curve)} steps) leaves the accounting's "
                   f"({len(totals)} steps) at step {first}.")
    return out


def replay_peak(snapshot, device=0):
    """The highest live bytes of the replay: the peak the viewer's timeline reaches."""
    return max(replay(snapshot, device))
