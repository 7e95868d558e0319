"""Chapter 3: ZeRO-3's gather, compute and free timeline, read from the hand FSDP, and with prefetch.

`record` trains the tiny GPT under `fsdp.HandFSDP` (one unit per block, the root last) and stamps,
on the host clock, every unit's all-gather, the compute that uses the gathered weights, its
reduce-scatter and the moment its full weights are freed, in forward and in backward. The hand FSDP
runs every collective on the rank's own thread, so the recorded step has one stream: a unit's gather
starts only when the unit is reached.

`prefetch` lays the same measured durations out as FSDP does on a GPU, with the collectives on a
second stream: the gather of the next unit is issued as soon as the previous gather ends and runs
beside this unit's compute, with at most ``depth`` units gathered ahead. That layout is a
simulation from measured durations, not a second measurement.
"""

import torch.distributed as dist

from labs.launcher import launch
from labs.measure import timing
from labs import model as tiny
from labs.zero import stages


class Recorder:
    """Wraps a HandFSDP's units: records (unit, kind, start, end) for gathers ("ag"), the compute
    that uses a block's gathered weights ("fwd", "bwd") and reduce-scatters ("rs"), in seconds from
    ``t0``. The root's compute spans the whole pass around the blocks, so only its collectives count."""

    def __init__(self, hand):
        self.events, self.t0, self._since, self.root = [], timing.now(), {}, len(hand.units) - 1
        for i, u in enumerate(hand.units):
            u.gather = self._gather(i, u, u.gather)
            u.free = self._free(i, u, u.free)
            u.post_backward = self._reduce(i, u, u.post_backward)

    def now(self):
        return timing.now() - self.t0

    def _end_compute(self, i, u):
        if i in self._since:
            self.events.append((i, "bwd" if u.in_backward else "fwd", self._since.pop(i), self.now()))

    def _gather(self, i, u, fn):
        def gather():
            fresh, start = not u.gathered, self.now()
            fn()
            if fresh:
                self.events.append((i, "ag", start, self.now()))
                if i != self.root:
                    self._since[i] = self.now()
        return gather

    def _free(self, i, u, fn):
        def free():
            self._end_compute(i, u)
            fn()
        return free

    def _reduce(self, i, u, fn):
        def post_backward():
            if u.done:
                return fn()
            self._end_compute(i, u)
            start = self.now()
            fn()
            self.events.append((i, "rs", start, self.now()))
        return post_backward


@launch.on_cpu("the timeline is read on the host clock around the hand FSDP's own-thread rings")
def record(rank, world_size, steps=2, batch_size=1):
    """One HandFSDP step on the tiny GPT, after ``steps - 1`` warm-up steps: the last step's events
    [(unit, kind, start, end)] in seconds, the units (blocks, then the root) and the most units
    gathered at once."""
    cfg = tiny.GPTConfig()
    net, opt, hand = stages.build(3, cfg, device="cpu")
    for step in range(steps):
        x, y = stages._batch(cfg, step, rank, batch_size, "cpu")
        if step == steps - 1:
            dist.barrier()   # the ranks start the recorded step together: no wait in its first gather
            rec = Recorder(hand)
        with stages._collectives("hand"):
            opt.zero_grad()
            net(x, y).backward()
            opt.step()
    return {"events": rec.events, "units": len(hand.units), "max_units_gathered": hand.max_units_gathered}


@launch.on_cpu("the timeline is read on the host clock around the hand FSDP's own-thread rings")
def fsdp2_and_record(rank, world_size, steps=2, batch_size=1, accumulate=False):
    """`stages.fsdp2_and_kept`, then `record`, then with ``accumulate`` `stages.accumulation` (under
    "accumulation"), in one job: each costs no second start of the ranks."""
    out = stages.fsdp2_and_kept(rank, world_size, steps, batch_size)
    out["timeline"] = record(rank, world_size)
    return {**out, "accumulation": stages.accumulation(rank, world_size)} if accumulate else out


def prefetch(events, units, depth=1):
    """The measured durations of ``events`` on two streams (simulated). Compute keeps the recorded
    order, and the recorded time between two computes that no collective took (embedding, head,
    loss); a block's gather is issued once the block ``depth + 1`` computes earlier has freed its
    weights, so it runs beside the compute before it; a reduce-scatter follows its block's backward;
    the collectives share one stream, in the order they are issued. Returns the new events and the
    most blocks gathered at once (`most_gathered`)."""
    order, root = sorted(events, key=lambda e: e[2]), units - 1
    comp = [e for e in order if e[1] in ("fwd", "bwd")]
    gather, root_gather, other, rs = [], {}, [], {}
    for u, k, s0, e0 in comp:   # each block's own gather, the root's before it, the time left over
        before = [e for e in order if e[1] == "ag" and e[3] <= s0]
        gather.append(next(e[3] - e[2] for e in reversed(before) if e[0] == u))
        prev = comp[comp.index((u, k, s0, e0)) - 1][3] if other else s0
        took = sum(e[3] - e[2] for e in order if e[1] in ("ag", "rs") and prev <= e[2] < s0)
        other.append(max(0.0, s0 - prev - took))
    for u, k, s0, e0 in order:
        if k == "ag" and u == root:
            root_gather[next(i for i, c in enumerate(comp) if c[2] > s0)] = e0 - s0
        if k == "rs":
            rs[u] = e0 - s0
    out, comm_free, end, g_end, gi = [], 0.0, [], [], 0
    for i, (u, k, s0, e0) in enumerate(comp):
        while gi <= min(i + depth, len(comp) - 1):
            release = end[gi - depth - 1] if gi - depth - 1 >= 0 else 0.0
            if gi in root_gather:
                start = max(comm_free, release)
                out.append((root, "ag", start, start + root_gather[gi]))
                comm_free = start + root_gather[gi]
            start = max(comm_free, release)
            out.append((comp[gi][0], "ag", start, start + gather[gi]))
            comm_free = start + gather[gi]
            g_end.append(comm_free)
            gi += 1
        start = max((end[-1] if end else 0.0) + other[i], g_end[i])
        out.append((u, k, start, start + e0 - s0))
        end.append(start + e0 - s0)
        if k == "bwd":
            start = max(comm_free, end[-1])
            out.append((u, "rs", start, start + rs[u]))
            comm_free = start + rs[u]
    start = max(comm_free, end[-1])   # the root's reduce-scatter closes the step
    out.append((root, "rs", start, start + rs[root]))
    return out, most_gathered(out, units)


def most_gathered(events, units):
    """The most block units (the root excluded) whose weights are held at once: from a gather's
    start to the end of the compute that uses them."""
    spans, pending = [], {}
    for u, k, s, e in sorted(events, key=lambda e: e[2]):
        if u == units - 1:
            continue
        if k == "ag":
            pending[u] = s
        elif k in ("fwd", "bwd") and u in pending:
            spans.append((pending.pop(u), e))
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    best = now = 0
    for _, step in edges:
        now += step
        best = max(best, now)
    return best


def step_time(events):
    return max(e for *_, e in events) - min(s for _, _, s, _ in events)
