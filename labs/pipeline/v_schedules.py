"""Chapter 5: the V-shaped schedules that ``torch.distributed.pipelining`` ships, ZB-V and DualPipeV,
on the same footing as the hand executor's schedules.

Both cut the model into 2p chunks and give rank r chunks r and 2p - 1 - r (a "V": a micro-batch
goes down the ranks on its first chunk and back up on its second, so rank 0 holds both the first
and the last chunk). ZB-V is Qi et al.'s (ICLR 2024, arXiv 2401.10241, §6); DualPipeV is the
one-direction variant of DeepSeek-V3's DualPipe (arXiv 2412.19437, §3.2.1) that torch builds from
deepseek-ai/DualPipe.

`library_order` asks the installed torch for each rank's compute actions, from the schedule
class's own ``_calculate_single_rank_operations`` (the method its constructor calls on every
rank), without starting processes. `simulate` runs those lists the way the hand executor's
logical clock runs its own: each action starts when its rank is free and the action it depends
on has finished, with fixed costs per chunk F = I = W = 1/2 (a chunk is half a stage of L/p
layers, whose split F = B = W = 1), a full backward I + W, and DualPipeV's overlapped F + B the
sum of its parts (one GPU computes them one after the other). The bubble and the peak number of
chunk micro-batches in flight (forward run, weight gradient not yet) are therefore *simulated* on
the library's order, not timed.
"""
from types import SimpleNamespace

CLASSES = {"zb-v": "ScheduleZBVZeroBubble", "dualpipe-v": "ScheduleDualPipeV"}
CHUNK = 0.5  # one chunk's F, I or W, in units of a whole stage's (L/p layers) F


def library_order(name, p, m):
    """Each rank's compute actions, as the library's schedule class orders them: a list per rank
    of tuples (kind, stage, micro-batch) with kind F, I (input gradient), W (weight gradient) or B
    (full backward); an overlapped F + B is a list of its two parts."""
    from torch.distributed.pipelining import schedules
    cls = getattr(schedules, CLASSES[name])
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    out = []
    for rank in range(p):
        acts = []
        for a in cls._calculate_single_rank_operations(fake, rank):
            if a is None:
                continue
            parts = a.sub_actions or (a,)
            acts.append([(x.computation_type.value, x.stage_index, x.microbatch_index) for x in parts])
        out.append(acts)
    return out


def _needs(kind, stage, mb, stages):
    """What an action waits for: the previous chunk's forward, the next chunk's input gradient
    (the last chunk's backward starts from its own forward), or its own input gradient (W)."""
    if kind == "F":
        return ("F", stage - 1, mb) if stage else None
    if kind in ("I", "B"):
        return ("I", stage + 1, mb) if stage < stages - 1 else ("F", stage, mb)
    return ("I", stage, mb)


def simulate(order, chunk=CHUNK):
    """Start and end of every action, per rank, on the library's order; raises on a deadlock."""
    p = len(order)
    stages = 2 * p
    cost = {"F": chunk, "I": chunk, "W": chunk, "B": 2 * chunk}
    done, pos, clock = {}, [0] * p, [0.0] * p
    timeline = [[] for _ in range(p)]
    while any(pos[r] < len(order[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(order[r]):
                parts = order[r][pos[r]]
                needs = [_needs(*a, stages) for a in parts]
                if any(n is not None and n not in done for n in needs):
                    break
                t = max([clock[r]] + [done[n] for n in needs if n is not None])
                for kind, stage, mb in parts:
                    t0, t = t, t + cost[kind]
                    done[("I" if kind == "B" else kind, stage, mb)] = t
                    if kind == "B":
                        done[("W", stage, mb)] = t
                    timeline[r].append({"kind": kind, "stage": stage, "mb": mb, "start": t0, "end": t})
                clock[r] = t
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the order deadlocks: some rank waits for an action that never runs.")
    return timeline


def summary(name, p, m):
    """Bubble over the total, peak chunk micro-batches in flight per rank (in whole-stage
    micro-batches: two chunks are one stage's L/p layers), and the timeline, simulated."""
    tl = simulate(library_order(name, p, m))
    end = max(e["end"] for evs in tl for e in evs)
    busy = sum(e["end"] - e["start"] for evs in tl for e in evs)
    peaks = []
    for evs in tl:
        held = peak = 0
        for e in evs:                      # a chunk micro-batch is held from its F to its W
            held += {"F": 1, "W": -1, "B": -1}.get(e["kind"], 0)
            peak = max(peak, held)
        peaks.append(peak)
    return {"schedule": name, "p": p, "m": m, "timeline": tl, "total": end,
            "ideal": 3 * m, "bubble_fraction": 1 - busy / (p * end),
            "bubble_over_ideal": (p * end - busy) / busy,
            "peak_chunks": peaks, "peak_stage_microbatches": [x * CHUNK for x in peaks]}


def events(timeline, p):
    """The timeline in `schedule_figure`'s form: rank r's chunk r is chunk 0, its returning chunk
    2p - 1 - r is chunk 1; I and full B are drawn as backward."""
    return [[{"action": ("F" if e["kind"] == "F" else "W" if e["kind"] == "W" else "B") + str(e["mb"])
              + (".1" if e["stage"] >= p else ""), "start": e["start"], "end": e["end"]} for e in evs]
            for evs in timeline]
