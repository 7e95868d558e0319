"""Chapter 14: the planner's search. Every setting of each layout, one at a time, the fastest that fits.

For each layout (`ParallelDims`) the settings are every ZeRO stage, recomputation, micro-batch size b
(`MICRO_BATCHES`), schedule and virtual stages v (`V_CHOICES`) and offload its stack offers
(`software`), less those a published row fixes: each a `grid.Candidate`. Memory (`memory.terms`) and
time (`timing`) are computed on the first stage (the embedding, the most warm-up micro-batches), the
first stage holding the most layers (chapter 5's split gives the ends fewer; `fullest_stage`) and the
last (the head and the logits). The fullest of the three decides what fits, the slowest the
micro-batch time.

A job's million candidates are priced in plain Python: memory first, time only for the candidates that
fit (and for the closest setting of a layout where none does), and every piece of a formula once per
distinct key of small integers (`Memo`), which a candidate's terms then add up.
"""
import functools
import itertools

from labs.dims import ParallelDims
from labs.formulas.planning import memory, offload, timing
from labs.formulas.planning.grid import Candidate
from labs.formulas.planning.software import RECOMPUTE, SCHEDULES

MICRO_BATCHES = (1, 2, 4, 8)
V_CHOICES = (2, 3, 4, 6, 8)
GIB = 2 ** 30


def schedules_for(job, d, m, fixed):
    """[(schedule, v)] the stack offers layout ``d`` at m micro-batches; a fixed v is checked."""
    L, sw, v_fixed = job.model.layers, job.software, fixed.get("v")
    if d.pp == 1:
        if v_fixed not in (None, 1):
            raise ValueError(f"v = {v_fixed} model chunks per stage needs a pipeline; this layout has "
                             "pp = 1.")
        return [("1f1b", 1)]
    flat = [(s, 1) for s in ("1f1b", "zero_bubble") if s in sw.schedules] or [("1f1b", 1)]
    if v_fixed is None:
        # an even split offers every v that divides the layers of a stage (Megatron-LM); otherwise `V_CHOICES`
        vs = [v for v in range(2, L // d.pp + 1) if L % (d.pp * v) == 0] if sw.uniform_stages else \
            [v for v in V_CHOICES if d.pp * v <= L + 2]
        return flat + ([("interleaved", v) for v in vs if m % d.pp == 0] if "interleaved" in sw.schedules
                       else [])
    most = (L + 2) // d.pp
    if not 1 <= v_fixed <= most:
        raise ValueError(f"v = {v_fixed} model chunks per stage is outside 1..{most}: pp = {d.pp} stages of "
                         f"{L} layers (and the embedding and head chunks) hold at most {most} each.")
    if v_fixed == 1:
        return flat
    if m % d.pp:
        raise ValueError(f"interleaved 1F1B with v = {v_fixed} needs the m = {m} micro-batches per step to "
                         "be a "
                         f"multiple of pp = {d.pp}.")
    return [("interleaved", v_fixed)]


def settings(job, d, fixed):
    """The settings of layout ``d``: ([(b, schedule, v)], [(zero, recompute, offload)]), tuples of ints
    (recompute and schedule as indices of `software.RECOMPUTE`, `SCHEDULES`), every pair of one of each a
    candidate; a fixed setting the stack does not offer, or a fixed b or v outside its range, is one
    sentence naming it."""
    sw, seqs = job.software, job.sequences // d.dp
    for key, offered in (("zero", sw.zero_stages), ("recompute", sw.recompute), ("offload", sw.offload)):
        if key in fixed and fixed[key] not in offered:
            raise ValueError(f"{key} = {fixed[key]!r} is not one {sw.name} offers "
                             f"({', '.join(map(str, offered))}).")
    b_fixed = fixed.get("micro_batch")
    if b_fixed is not None and (b_fixed < 1 or seqs % b_fixed):
        raise ValueError(f"b = {b_fixed} sequences per micro-batch does not divide the {seqs:,} sequences "
                         "each of "
                         f"the dp = {d.dp} replicas takes per step.")
    bs = [b_fixed] if b_fixed else [b for b in MICRO_BATCHES if seqs % b == 0]
    if not sw.accumulation and d.pp == 1 and not b_fixed:   # one forward and backward of the local batch
        bs = [seqs]
    if fixed.get("v", 1) > 1 and not b_fixed:     # interleaving needs m = seqs / b to be a multiple of pp
        bs = [b for b in bs if (seqs // b) % d.pp == 0] or bs[:1]
    zeros = [fixed["zero"]] if "zero" in fixed else sw.zero_stages
    if d.dp_replicate > 1:                         # HSDP is FSDP's: replicas only of sharded weights
        zeros = [z for z in zeros if z == 3]
        if not zeros:
            raise ValueError(f"dp_replicate = {d.dp_replicate} is HSDP, which shards with ZeRO-3 (FSDP); "
                             f"the settings allow ZeRO-{fixed.get('zero')}.")
    rest = list(itertools.product(
        zeros,
        [RECOMPUTE.index(fixed["recompute"])] if "recompute" in fixed else [RECOMPUTE.index(r)
                                                                            for r in sw.recompute],
        [int(fixed["offload"])] if "offload" in fixed else [int(o) for o in sw.offload]))
    rows = [(b, SCHEDULES.index(s), v) for b in bs for s, v in schedules_for(job, d, seqs // b, fixed)]
    return rows, rest


def candidates(job, d, fixed):
    """Every candidate of layout ``d`` on stage 0: each (b, schedule, v) of `settings` with each (zero,
    recompute, offload) in turn."""
    sw, dims = job.software, (d.tp, d.pp, d.cp, d.ep, d.dp, d.dp_replicate)
    last = (int(sw.reshards(d.pp)), int(sw.sp), fixed.get("checkpoint_every", 1), 0, d.etp)
    rows, rest = settings(job, d, fixed)
    return [Candidate._make(dims + (z, r, b, v, job.sequences // (d.dp * b), s, o) + last)
            for b, s, v in rows for z, r, o in rest]


@functools.lru_cache(maxsize=None)
def fullest_stage(model, pp, v):
    """The first stage holding the most layers (chapter 5's split can give the ends fewer): of those,
    the one with the most micro-batches in flight, as the schedules warm up the earlier stages more."""
    counts = [memory.stage_layer_counts(model, pp, v, s)[0] for s in range(pp)]
    return counts.index(max(counts))


class Memo(timing.Pieces):
    """`timing.Pieces` and memory's pieces, for one job and eta: the functions `memory.terms` calls, so a
    candidate's total here is the sum of its terms there, bit for bit."""

    def __init__(self, job, eta):
        super().__init__(job, eta)
        memo, m, sw, cl = functools.lru_cache(maxsize=None), job.model, job.software, job.cluster
        self.stages = memo(lambda pp, v: tuple(dict.fromkeys((0, fullest_stage(m, pp, v), pp - 1))))
        # weights + gradients + optimizer: the first three TERMS, added as `memory.total` adds them, at each
        # (zero, offload) of ``settings``
        self.state = memo(lambda tp, pp, cp, ep, dp, dpr, etp, v, st, settings: {(z, o): memory.total(
            float(t) for t in memory.state_terms(m, tp, pp, ep, v, st, z, memory.zero_group(z, dp, dpr, cp),
                                                 job.recipe, bool(o), etp)) for z, o in settings})
        self.acts = memo(functools.partial(memory.stage_activations, m, job.kernels))
        self.tail = memo(lambda tp, cp, b: float(memory.logits_bytes(m, tp, cp, b, sw.eager_loss)))
        self.fsdp = memo(lambda *k: memory.fsdp_buffer_bytes(m, *k[:-1], sw.shard_unit, sw.reduce_bytes,
                                                             k[-1]))
        self.buffers = memo(functools.partial(memory.stage_buffers, m))
        self.host_ok = memo(lambda *k: offload.host_bytes(_shard_params(job, *k), cl.gpus_per_node)
                            <= cl.host_bytes)


def best_per_layout(job, eta, layouts, fixed=None, closest=False):
    """For each layout: its fastest fitting setting as a row (dims, plan, m, time, memory), or
    {"dims", "reason", "term"} naming what overflows at its closest setting (``closest``: that setting,
    timed, as well: a published layout that ran is timed where the count says it does not fit). A layout
    fits when the count is at most the GPU's memory (`shapes.RESERVE` is an assumption reported beside it,
    not a limit)."""
    fixed, memo, out = fixed or {}, Memo(job, eta), []
    hbm = job.cluster.hbm_bytes
    for d in layouts:
        c, fitting = _search(memo, d, fixed, hbm)
        terms, _, _, time = price(job, eta, c, memo)
        row = _row(d, c, terms, time)
        if fitting:
            out.append(row)
            continue
        term = memory.overflow(terms, hbm) or "host memory"
        plan = row["plan"]
        of = f"{hbm / GIB:.2f} GiB"
        reason = (f"{term} overflows: {memory.total(terms) / GIB:.1f} GiB at best (ZeRO-{plan.zero}, "
                  f"recompute {plan.recompute}, b = {plan.micro_batch}, v = {plan.v}) of {of}"
                  if term != "host memory" else
                  f"host memory overflows: the offloaded optimizer state needs more than the node's "
                  f"{job.cluster.host_bytes / GIB:.0f} GiB")
        out.append({**row, "reason": reason, "term": term} if closest else
                   {"dims": d, "reason": reason, "term": term, "memory": row["memory"]})
    return out


def _search(memo, d, fixed, hbm):
    """(candidate, True): layout d's fastest candidate that fits; else (candidate, False): the one with the
    least memory among those whose node holds their offloaded state, or the first. Ties go to the first
    in `settings` order. Only the candidates that fit are timed."""
    job = memo.job
    cands, (_, rest) = candidates(job, d, fixed), settings(job, d, fixed)
    nodes = memo.nodes(*cands[0][:6])
    # the distinct settings each piece of memory depends on, besides the row's
    keys = rest, *(tuple(dict.fromkeys(k)) for k in zip(*[((z, o), r, z) for z, r, o in rest]))
    best = near = None                           # (seconds, candidate), (bytes, candidate)
    per_stage = {}                               # (v, stage): the pieces that need neither b nor schedule
    for i in range(0, len(cands), len(rest)):    # a row: one b, schedule and v, with every `rest`
        row = cands[i:i + len(rest)]
        totals = [_stage_totals(memo, row[0], st, per_stage, *keys) for st in memo.stages(d.pp, row[0].v)]
        slowest = {}                  # by recomputation: the micro-batch does not depend on the rest
        for c, fullest in zip(row, map(max, zip(*totals))):
            host_ok = not c.offload or memo.host_ok(c.tp, c.pp, c.cp, c.ep, c.dp, c.dpr, c.v, c.zero)
            if fullest <= hbm and host_ok:
                if c.rc not in slowest:
                    slowest[c.rc] = _slowest(memo, c, nodes)
                mb, _, first = slowest[c.rc]
                seconds = timing.step(job, memo.eta, c, mb, first, nodes, memo)["step"]
                if best is None or seconds < best[0]:
                    best = (seconds, c)
            elif best is None and host_ok and (near is None or fullest < near[0]):
                near = (fullest, c)
    return (best[1], True) if best else (near[1] if near else cands[0], False)


def _stage_totals(memo, c, st, per_stage, rest, zero_offload, recomputes, zeros):
    """The bytes on stage st of candidate c's row (its b, schedule and v) at each (zero, recompute,
    offload) of ``rest``: the six TERMS added in order (`memory.total`), each piece looked up once, by
    the distinct settings it depends on (``per_stage``: this layout's, by v and stage)."""
    if (c.v, st) not in per_stage:
        per_stage[c.v, st] = (memo.state(c.tp, c.pp, c.cp, c.ep, c.dp, c.dpr, c.etp, c.v, st, zero_offload),
                              {z: memo.fsdp(z, c.tp, c.pp, c.ep, c.v, st, c.reshard, c.etp) for z in zeros})
    state, fsdp = per_stage[c.v, st]
    acts = {r: memo.acts(c.pp, c.v, st, c.sched, c.m, c.b, c.tp, c.cp, r, c.sp, c.ckpt) for r in recomputes}
    tail = memo.tail(c.tp, c.cp, c.b) if st == c.pp - 1 else 0.0
    buf = {z: memo.buffers(fsdp[z], c.tp, c.sp, c.b, c.cp) for z in zeros}
    return [state[z, o] + acts[r] + tail + buf[z] for z, r, o in rest]


def _slowest(memo, c, nodes):
    """(the micro-batch of c's slowest stage, that stage, the micro-batch of its first stage): the first of
    the slowest, in the order stage 0, the fullest, the last."""
    stages = memo.stages(c.pp, c.v)
    mbs = timing.micro_batches(memo.job, memo.eta, c, stages, nodes, memo)
    t = [mb["t_mb"] for mb in mbs]
    i = t.index(max(t))
    return mbs[i], stages[i], mbs[0]


def price(job, eta, c, memo=None):
    """Candidate c (on stage 0) in full: (the TERMS of its fullest stage, fits, the node's host memory holds
    its offloaded state, time: `timing.step` with the slowest stage's exposed seconds)."""
    memo, sw = memo or Memo(job, eta), job.software
    stages = memo.stages(c.pp, c.v)
    mems = [memory.terms(job.model, c.on(st), job.recipe, job.kernels, sw.shard_unit,
                         sw.reduce_bytes, sw.eager_loss) for st in stages]
    totals = [memory.total(t) for t in mems]
    i = totals.index(max(totals))
    host_ok = not c.offload or memo.host_ok(c.tp, c.pp, c.cp, c.ep, c.dp, c.dpr, c.v, c.zero)
    nodes = memo.nodes(c.tp, c.pp, c.cp, c.ep, c.dp, c.dpr)
    mb, stage, first = _slowest(memo, c, nodes)
    time = timing.step(job, eta, c, mb, first, nodes, memo)
    time.update({f"exposed_{g}": c.m * mb[g] for g in ("tp", "cp", "ep", "pp")})
    time.update(compute=c.m * mb["compute"], t_max=mb["t_mb"], slowest_stage=float(stage),
                memory_stage=float(stages[i]))
    return mems[i], totals[i] <= job.cluster.hbm_bytes and host_ok, host_ok, time


def _shard_params(job, tp, pp, cp, ep, dp, dpr, v, zero):
    """Parameters in the optimizer partition of the first-stage rank."""
    plan = memory.Plan(ParallelDims(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, fold_ep=job.software.folds(ep)), v=v)
    group = memory.zero_group(zero, dp, dpr, cp) if zero >= 1 else 1
    return sum(memory.rank_params(job.model, plan, 0).values()) / group


def _row(d, c, terms, time):
    plan = memory.Plan(d, zero=c.zero, recompute=c.recompute, micro_batch=c.b, v=c.v, sp=bool(c.sp),
                       zero_bubble=SCHEDULES[c.sched] == "zero_bubble", offload=bool(c.offload),
                       reshard=bool(c.reshard), checkpoint_every=c.ckpt)
    return {"dims": d, "plan": plan, "m": c.m, "memory": dict(zip(memory.TERMS, terms)),
            "memory_stage": int(time["memory_stage"]), "time": time}
