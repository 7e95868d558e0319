"""Chapter 5: pipeline schedules as data, one ordered list of actions per stage.

An action is F (forward), B (backward; under a split backward only the input gradient) or W (the
weight gradient, split schedules only) of one micro-batch on one model chunk. p stages (ranks), m
micro-batches, v chunks per rank for interleaved 1F1B (rank r holds chunks r, r + p, r + 2p, ...).

Bubbles, each formula named by its source:
  GPipe (Huang et al. 2018, NeurIPS 2019, arXiv 1811.06965, §2.3): the bubble is O((K-1)/(M+K-1)) of the total
      time, K partitions and M micro-batches; exactly (p-1)/(m+p-1) with balanced stages.
  GPipe and 1F1B (Narayanan et al. 2021, SC21, arXiv 2104.04473, §2.2.1): the "bubble time
      fraction" t_pb / t_id = (p-1)/m, bubble over ideal compute, derived for GPipe's schedule
      and the same for 1F1B (PipeDream-Flush). Over the total: x / (1 + x) = (p-1)/(m+p-1).
  Interleaved 1F1B (ibid. §2.2.2): (1/v) (p-1)/m over ideal.
  ZB-H1 (Qi et al., "Zero Bubble (Almost) Pipeline Parallelism", ICLR 2024; arXiv 2401.10241,
  "Zero Bubble Pipeline Parallelism", §2.1 and Table 2):
      the bubble is (p-1)(T_F + T_B - T_W), against 1F1B's (p-1)(T_F + T_B + T_W). At
      T_F = T_B = T_W = 1: stage 0 runs p forwards, then waits for micro-batch 0's B, which
      leaves stage p-1 at time p + 1 and takes one unit per stage back: it starts on stage 0 at
      2p - 1, after p - 1 idle units; B, W and F then keep stage 0 busy to the end. The ideal
      time is 3m, so bubble over ideal = (p-1)/(3m), a third of 1F1B's, for m >= p. With m < p
      stage 0 runs out of forwards at time m and idles 2p - 1 - m units: (2p-1-m)/(3m).
Work units per full stage: F = 1 and B = 2 (backward costs twice the forward), or, split, F = B = W = 1.
"""
from fractions import Fraction
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "greedy-bfw")
SPLIT = ("zb-h1", "greedy-bfw")  # schedules whose backward is split into B and W


class Action(NamedTuple):
    kind: str    # "F", "B" or "W"
    mb: int      # micro-batch
    chunk: int = 0

    def __repr__(self):
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def gpipe(p, m):
    """All forwards, then all backwards: every stage holds all m micro-batches at the peak."""
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p, m):
    """PipeDream-Flush: stage s warms up with p-1-s forwards, then alternates, then drains.

    Stage s holds at most min(p - s, m) micro-batches. Stage 0's p micro-batches of L/p layers
    each are L layers' worth of activations whatever p is: pipelining divides weights, gradients
    and optimizer state by p, not stage 0's activations (measured in bytes by labs.pipeline.executor).
    """
    out = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        acts = [Action("F", i) for i in range(warmup)]              # warm-up
        for i in range(m - warmup):                                 # steady state: one F, one B
            acts += [Action("F", warmup + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warmup, m)]      # cool-down
        out.append(acts)
    return out


def interleaved(p, m, v):
    """Megatron's interleaved 1F1B: micro-batches go through each rank's v chunks in groups of p.

    Its longer warm-up costs memory: stage 0 holds up to 2(p-1) + (v-1)p + 1 chunk micro-batches
    of L/(pv) layers, more than 1F1B's L layers (p = 3, v = 2: 8 chunks, 4/3 L; p = 4, v = 2: 11/8 L).
    """
    if m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches through the chunks in groups of p: "
                         f"m={m} is not a multiple of p={p}; use m={-(-m // p) * p}.")
    def order(chunks):  # (mb, chunk) in the order a rank runs them
        return [Action("F", g * p + i, c) for g in range(m // p) for c in chunks for i in range(p)]
    out = []
    for s in range(p):
        fwd = order(range(v))
        bwd = [Action("B", a.mb, a.chunk) for a in order(list(reversed(range(v))))]
        warmup = min((p - 1 - s) * 2 + (v - 1) * p, m * v)
        acts = fwd[:warmup]                                         # warm-up
        for i in range(m * v - warmup):                             # steady state
            acts += [fwd[warmup + i], bwd[i]]
        acts += bwd[m * v - warmup:]                                # cool-down
        out.append(acts)
    return out


def zb_h1(p, m):
    """ZB-H1 (Qi et al. 2024, §2.1 and Figure 3, top): 1F1B's order of F and B, with each W deferred.

    Stage s runs W of micro-batch i right after B of micro-batch i + s, and its last s W passes
    after its last B: they fill the cool-down bubble that 1F1B leaves there. Deferring by s keeps
    p micro-batches in flight (F done, W not yet) on every stage: stage s holds p - s awaiting B,
    as in 1F1B, plus s awaiting only W, whose activations are smaller (Table 1: 32sbh bytes against
    B's sb(34h + 5as)). So stage 0, W never deferred, has the peak: 1F1B's p micro-batches.
    """
    out = []
    for s, order in enumerate(one_f_one_b(p, m)):
        acts = []
        for a in order:
            acts.append(a)
            if a.kind == "B" and a.mb >= s:
                acts.append(Action("W", a.mb - s))                      # W deferred by s micro-batches
        acts += [Action("W", i) for i in range(max(0, m - s), m)]       # cool-down: the last s W passes
        out.append(acts)
    return out


def greedy_bfw(p, m):
    """Not a paper's schedule: a greedy list schedule with the backward split, kept for contrast.

    Built by running the pipeline in unit time with a rule per stage: a ready B first, then a F
    while at most p - s micro-batches await their B (1F1B's bound) and at most 2p - 1 - s await
    their W, then a W. It reaches ZB-H1's bubble, (p-1)/(3m) for m >= p, but greedily putting F
    before W leaves up to 2p - 1 - s micro-batches in flight on stage s ([7, 6, 5, 4] at p = 4,
    m >= 7) where ZB-H1 holds p: up to p - 1 more micro-batches' W activations for no gain in
    unit time. Nor is it ZB-H2 (§2.2): ZB-H2 runs more F passes in the warm-up (up to 2p - 1
    awaiting B on stage 0, peak (2p-1) M_B) to reach a zero bubble, (p-1)(T_F + T_B - 2 T_W) = 0.
    """
    return _greedy(p, m, priority="BFW", limit=lambda s: p - s, hold=lambda s: 2 * p - 1 - s)


MAX_ACTIONS = 3_000_000


def build(name, p, m, v=1):
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}.")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, micro-batches and chunks must be at least 1 (got p={p}, m={m}, v={v}).")
    if 3 * p * m * v > MAX_ACTIONS:  # a schedule is a list of F, B and W actions per stage and chunk
        raise ValueError(f"p={p} stages x m={m:,} micro-batches x v={v} chunks make "
                         f"{3 * p * m * v:,} actions, above the {MAX_ACTIONS:,} this lab builds in memory; "
                         "lower the micro-batches.")
    if name == "interleaved":
        return interleaved(p, m, v)
    if v != 1:
        raise ValueError(f"--chunks {v} applies to the interleaved schedule only; use 1 for {name}.")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "greedy-bfw": greedy_bfw}[name](p, m)


def costs(name, v=1):
    """Work units per action: F = 1, B = 2 per full stage; split, B = W = 1; a chunk is 1/v."""
    return {"F": 1 / v, "B": 1 / v, "W": 1 / v} if name in SPLIT else {"F": 1 / v, "B": 2 / v, "W": 0}


def formula(name, p, m, v=1):
    """Bubble over ideal compute time, and over total time, for each schedule (sources above)."""
    split = (p - 1 + max(0, p - m)) / (3 * m)    # Qi et al. Table 2 at T_F = T_B = T_W; m < p above
    over_ideal = {"gpipe": (p - 1) / m, "1f1b": (p - 1) / m, "interleaved": (p - 1) / (v * m),
                  "zb-h1": split, "greedy-bfw": split}[name]
    return {"over_ideal": over_ideal, "over_total": over_ideal / (1 + over_ideal)}


def depends_on(a, s, p, v):
    """The (stage, action) whose message ``a`` on stage ``s`` waits for, or None."""
    k = a.chunk * p + s                      # index of this piece of the model, 0 .. p*v - 1
    last = p * v - 1
    if a.kind == "F":
        return None if k == 0 else ((k - 1) % p, Action("F", a.mb, (k - 1) // p))
    if a.kind == "B":
        return (s, Action("F", a.mb, a.chunk)) if k == last else ((k + 1) % p,
                                                                  Action("B", a.mb, (k + 1) // p))
    return (s, Action("B", a.mb, a.chunk))   # W needs this stage's own B


def simulate(lists, cost, v=1, latency=0.0):
    """Start and end of every action when each waits for its own stage and its message
    (``latency`` is added to every message between stages). ``cost``: work per kind, one dict
    for every stage, a list of one dict per stage (stages of unequal cost,
    `labs.pipeline.stage_balance`), or per stage a list of one dict per chunk."""
    p = len(lists)
    end, pos, clock, timeline = {}, [0] * p, [0.0] * p, [[] for _ in range(p)]
    while any(pos[s] < len(lists[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(lists[s]):
                a = lists[s][pos[s]]
                dep = depends_on(a, s, p, v)
                if dep is not None and dep not in end:
                    break
                arrival = end[dep] + (latency if dep[0] != s else 0.0) if dep else 0.0
                start = max(clock[s], arrival)
                c = cost[s] if isinstance(cost, (list, tuple)) else cost
                clock[s] = end[(s, a)] = start + (c[a.chunk] if isinstance(c, (list, tuple)) else c)[a.kind]
                timeline[s].append((a, start, clock[s]))
                pos[s] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: some stage waits for an action that never runs.")
    return timeline


def _greedy(p, m, priority, limit, hold):
    """Stage lists from a run in unit time where each stage picks by ``priority`` when free."""
    lists, end, clock = [[] for _ in range(p)], {}, [0.0] * p
    state = [{"F": 0, "B": 0, "W": 0} for _ in range(p)]     # next micro-batch of each kind
    while any(st["W"] < m for st in state):
        best = None
        for s in range(p):
            for kind in priority:
                a = Action(kind, state[s][kind])
                held, waiting = state[s]["F"] - state[s]["W"], state[s]["F"] - state[s]["B"]
                if a.mb >= m or (kind == "F" and (waiting >= limit(s) or held >= hold(s))):
                    continue
                if kind == "W" and state[s]["W"] >= state[s]["B"]:
                    continue
                dep = depends_on(a, s, p, 1)
                if dep is not None and dep not in end:
                    continue
                start = max(clock[s], end[dep] if dep else 0.0)
                if best is None or start < best[0]:
                    best = (start, s, a)
                    # among actions of one stage at the same start, the first in priority wins
        start, s, a = best
        clock[s] = end[(s, a)] = start + 1.0
        lists[s].append(a)
        state[s][a.kind] += 1
    return lists


def stage_busy(timeline):
    """Busy time of every stage of a timeline (``bubble`` takes stage 0's: equal on every stage
    only if the builder gave each stage all its work, which tests/test_pipeline.py asserts)."""
    return [sum(end - start for _, start, end in stage) for stage in timeline]


def bubble(timeline, cost):
    """Simulated bubble of a timeline: idle share of the total, and idle over ideal compute."""
    total = max(t[-1][2] for t in timeline)
    busy = sum(cost[a.kind] for a, _, _ in timeline[0])
    return {"over_total": (total - busy) / total, "over_ideal": (total - busy) / busy}


def peak_inflight(actions):
    """Most micro-batch chunks whose activations a stage holds at once (F done, last backward not)."""
    release = "W" if any(a.kind == "W" for a in actions) else "B"
    held = peak = 0
    for a in actions:
        held += (a.kind == "F") - (a.kind == release)
        peak = max(peak, held)
    return peak


def peak_chunks(name, p, m, v=1, stage=0):
    """Most micro-batch chunks stage ``stage`` holds at once, in closed form (chapter 14's planner
    multiplies it by a chunk's activations): GPipe m; 1F1B min(p - s, m); interleaved 1F1B
    min(2(p - 1 - s) + (v - 1)p + 1, m v), the warm-up of `interleaved` plus the one in flight.
    Equal to `peak_inflight` of the built schedule (tests/test_planning.py)."""
    if name not in ("gpipe", "1f1b", "interleaved") or not 0 <= stage < p:
        raise ValueError(f"peak_chunks knows gpipe, 1f1b and interleaved on stages 0..p-1, got {name!r}, "
                         f"stage {stage} of p={p}.")
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - stage, m)
    return min(2 * (p - 1 - stage) + (v - 1) * p + 1, m * v)


def microbatches_for(p, target):
    """Fewest micro-batches that keep 1F1B's bubble / total below ``target``."""
    m = 1
    while formula("1f1b", p, m)["over_total"] >= target:
        m += 1
    return m


def microbatches_to_halve(p, m):
    """Fewest micro-batches whose 1F1B bubble, as a share of the total time, is at most half of
    that with ``m``, counted in exact fractions. (p-1)/(m'+p-1) <= (p-1)/(2(m+p-1)) gives
    m' = 2m + p - 1: doubling m does not halve the share, since the p - 1 idle slots stay."""
    half = Fraction(p - 1, m + p - 1) / 2
    m_new = m
    while Fraction(p - 1, m_new + p - 1) > half:
        m_new += 1
    return m_new


