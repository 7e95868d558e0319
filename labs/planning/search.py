"""Chapter 14: the planner's search. Every setting of each layout, priced at once, the fastest that fits.

For each layout (`ParallelDims`) the settings are every ZeRO stage, recomputation, micro-batch size b
(`MICRO_BATCHES`), schedule and virtual stages v (`V_CHOICES`) and offload its stack offers
(`software`), less those a published row fixes. All candidates of all layouts become one set of
columns (`grid.Columns`); memory (`memory.terms`) and time (`timing`) are computed on the first stage
(the embedding, the most warm-up micro-batches), the first stage holding the most layers (chapter 5's
split gives the ends fewer; `fullest_stage`) and the last (the head and the logits). The fullest of
the three decides what fits, the slowest the micro-batch time.
"""
import functools
import itertools

import numpy as np

from labs.dims import ParallelDims
from labs.planning import memory, offload, timing
from labs.planning.grid import Columns, per_unique
from labs.planning.software import RECOMPUTE, SCHEDULES

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
    """Every (zero, recompute, b, schedule, v, offload) of layout ``d`` as an int array, one row each
    (recompute and schedule as indices of `software.RECOMPUTE`, `SCHEDULES`); a fixed setting the stack
    does not offer, or a fixed b or v outside its range, is one sentence naming it."""
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
    rest = np.array(list(itertools.product(
        zeros,
        [RECOMPUTE.index(fixed["recompute"])] if "recompute" in fixed else [RECOMPUTE.index(r)
                                                                            for r in sw.recompute],
        [int(fixed["offload"])] if "offload" in fixed else [int(o) for o in sw.offload])), dtype=np.int64)
    pipe = np.array([(b, SCHEDULES.index(s), v) for b in bs for s, v in schedules_for(job, d, seqs // b,
                                                                                      fixed)],
                    dtype=np.int64)
    both = np.concatenate([np.repeat(pipe, len(rest), axis=0), np.tile(rest, (len(pipe), 1))], axis=1)
    return both[:, [3, 4, 0, 1, 2, 5]]               # zero, recompute, b, schedule, v, offload


def candidates(job, layouts, fixed):
    """(`grid.Columns` of every candidate on stage 0, the index of its layout in ``layouts``)."""
    blocks, index = [], []
    for i, d in enumerate(layouts):
        s = settings(job, d, fixed)
        const = [d.tp, d.pp, d.cp, d.ep, d.dp, d.dp_replicate, int(job.software.reshards(d.pp)),
                 int(job.software.sp), fixed.get("checkpoint_every", 1), d.etp]
        blocks.append(np.concatenate([np.tile(np.array(const, dtype=np.int64), (len(s), 1)), s], axis=1))
        index.append(np.full(len(s), i))
    cols = np.concatenate(blocks)
    names = ("tp", "pp", "cp", "ep", "dp", "dpr", "reshard", "sp", "ckpt", "etp", "zero", "rc", "b", "sched",
             "v", "offload")
    c = Columns.of(**{k: cols[:, j] for j, k in enumerate(names)}, m=0, stage=0)
    c["m"] = job.sequences // (c["dp"] * c["b"])
    return c, np.concatenate(index)


@functools.lru_cache(maxsize=None)
def fullest_stage(model, pp, v):
    """The first stage holding the most layers (chapter 5's split can give the ends fewer): of those,
    the one with the most micro-batches in flight, as the schedules warm up the earlier stages more."""
    counts = [memory.stage_layer_counts(model, pp, v, s)[0] for s in range(pp)]
    return counts.index(max(counts))


def price(job, eta, c):
    """Memory (the fullest of three stages) and time of every candidate: (terms, fits, step parts)."""
    slots = [c.take(slice(None)) for _ in range(3)]
    slots[1]["stage"] = per_unique(lambda pp, v: fullest_stage(job.model, pp, v), c["pp"],
                                   c["v"]).astype(np.int64)
    slots[2]["stage"] = c["pp"] - 1
    sw = job.software
    mem = [np.stack(memory.terms(job.model, s, job.recipe, job.kernels, sw.shard_unit, sw.reduce_bytes,
                                 sw.eager_loss)) for s in slots]   # (3, 6, n)
    totals = np.stack([t.sum(axis=0) for t in mem])
    fullest = totals.argmax(axis=0)
    terms = np.stack(mem)[fullest, :, np.arange(len(c))].T                                   # (6, n)
    fits = totals.max(axis=0) <= job.cluster.hbm_bytes
    nodes = timing.node_counts(job, c)
    mbs = [timing.micro_batch(job, eta, s, nodes) for s in slots]
    slowest_i = np.stack([mb["t_mb"] for mb in mbs]).argmax(axis=0)
    slowest = {k: np.stack([mb[k] for mb in mbs])[slowest_i, np.arange(len(c))] for k in mbs[0]}
    time = timing.step(job, eta, c, slowest, mbs[0], nodes)
    time.update({f"exposed_{g}": c["m"] * slowest[g] for g in ("tp", "cp", "ep", "pp")})
    time.update(compute=c["m"] * slowest["compute"], t_max=slowest["t_mb"], slowest_stage=np.choose(
        slowest_i, [s["stage"] for s in slots]), memory_stage=np.choose(fullest, [s["stage"] for s in slots]))
    host_ok = np.ones(len(c), dtype=bool)
    if c["offload"].any():
        params = np.array([_shard_params(job, c, i) for i in range(len(c))])
        host_ok = (c["offload"] == 0) | (offload.host_bytes(params, job.cluster.gpus_per_node)
                                         <= job.cluster.host_bytes)
    return terms, fits & host_ok, host_ok, time


def _shard_params(job, c, i):
    """Parameters in the optimizer partition of candidate i's first-stage rank."""
    d = {k: int(c[k][i]) for k in c}
    plan = memory.Plan(ParallelDims(tp=d["tp"], pp=d["pp"], cp=d["cp"], ep=d["ep"], dp=d["dp"],
                                    fold_ep=job.software.folds(d["ep"])), v=d["v"])
    group = d["dp"] // (d["dpr"] if d["zero"] == 3 else 1) * d["cp"] if d["zero"] >= 1 else 1
    return sum(memory.rank_params(job.model, plan, 0).values()) / group


def best_per_layout(job, eta, layouts, fixed=None, closest=False):
    """For each layout: its fastest fitting setting as a row (dims, plan, m, time, memory), or
    {"dims", "reason", "term"} naming what overflows at its closest setting (``closest``: that setting,
    timed, as well: a published layout that ran is timed where the count says it does not fit)."""
    fixed = fixed or {}
    if not layouts:
        return []
    c, index = candidates(job, layouts, fixed)
    terms, fits, host_ok, time = price(job, eta, c)
    total = terms.sum(axis=0)
    out = []
    for i, d in enumerate(layouts):
        mine = np.flatnonzero(index == i)
        ok = mine[fits[mine]]
        if ok.size:
            out.append(_row(job, d, c, ok[np.argmin(time["step"][ok])], terms, time))
            continue
        k = mine[np.argmin(total[mine] + np.where(host_ok[mine], 0,
                                                  np.inf))] if host_ok[mine].any() else mine[0]
        first = memory.first_overflow(terms[:, [k]], job.cluster.hbm_bytes)[0]
        term = memory.TERMS[first] if first < len(memory.TERMS) else "host memory"
        row = _row(job, d, c, k, terms, time)
        reason = (f"{term} overflows: {total[k] / GIB:.1f} GiB at best (ZeRO-{row['plan'].zero}, recompute "
                  f"{row['plan'].recompute}, b = {row['plan'].micro_batch}, v = {row['plan'].v}) of "
                  f"{job.cluster.hbm_bytes / GIB:.0f} GiB" if term != "host memory" else
                  f"host memory overflows: the offloaded optimizer state needs more than the node's "
                  f"{job.cluster.host_bytes / GIB:.0f} GiB")
        out.append({**row, "reason": reason, "term": term} if closest else
                   {"dims": d, "reason": reason, "term": term, "memory": row["memory"]})
    return out


def _row(job, d, c, k, terms, time):
    plan = memory.Plan(d, zero=int(c["zero"][k]), recompute=RECOMPUTE[c["rc"][k]], micro_batch=int(c["b"][k]),
                       v=int(c["v"][k]), sp=bool(c["sp"][k]), zero_bubble=SCHEDULES[c["sched"][k]]
                       == "zero_bubble",
                       offload=bool(c["offload"][k]), reshard=bool(c["reshard"][k]),
                       checkpoint_every=int(c["ckpt"][k]))
    return {"dims": d, "plan": plan, "m": int(c["m"][k]), "memory": dict(zip(memory.TERMS, terms[:,
                                                                                                 k].tolist())),
            "memory_stage": int(time["memory_stage"][k]),
            "time": {key: float(v[k]) for key, v in time.items()}}
