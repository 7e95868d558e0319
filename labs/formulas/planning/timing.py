"""Chapter 14: the estimated step time of a layout, phase by phase, with what each stack overlaps.

    step = m t_max (1 + bubble) + exposed data-parallel time + optimizer step

- t_max: the slowest stage's micro-batch: its layers' compute (`kernels`: every GEMM on a roofline at
  a calibrated efficiency eta, attention, the memory-bound ops, recomputation) plus the exposed part
  of each collective it waits for (`traffic.layer_calls`, `traffic.stage_calls`), each priced at
  NCCL's latency plus its bytes over its link tier (`links`). Exposed per phase: a collective the
  stack overlaps (`software`) costs only what the compute it hides under does not cover: tensor-
  parallel collectives under the layer's GEMMs, context parallelism's K/V under the attention, the
  experts' all-to-alls and the pipeline's sends under the whole micro-batch (interleaved or zero-bubble
  schedules only); otherwise in full.
- bubble: chapter 5's bubble over ideal time, (p-1)/m for 1F1B, (p-1)/(v m) interleaved
  (Narayanan et al. 2021, §2.2), and (p - 1 + max(0, p - m))/(3m) for the zero-bubble schedule
  (`schedules.formula`): ZB-H1's (p - 1)/(3m) at T_F = T_B = T_W (Qi et al., "Zero Bubble Pipeline
  Parallelism", ICLR 2024, Table 2); the max(0, p - m) term for m < p is this lab's extension;
- data parallelism, on the first stage, the last to finish its backward (chapter 5): the gradient
  reduction under the last micro-batch's backward when overlapped (ZeRO-2's reduction of every other
  micro-batch under the next one's forward and backward), the updated weights' all-gather under the
  next forward; ZeRO-3 / FSDP gathers per micro-batch (twice when it reshards after
  forward), prefetched under compute where the stack prefetches, all but the first unit's;
- the optimizer step: Adam's bytes per parameter of the rank's shard at the memory's bandwidth, or
  in host memory under offload (`offload`).
- compute shared with a collective (Calculon's ``processor_usage``, Isaev et al. SC'23; calculon-ai/calculon
  at caa4b11, calculon/network.py and calculon/llm/llm.py): while NCCL runs, its kernels hold a share u
  of the GPU, so the compute it hides under runs at 1 - u of its speed; Calculon's DP overlap prices
  that as u times the overlapped time (u min(comm, compute), its `overlap_inflection` branches), and
  the planner extends that convention to every group (Calculon's TP overlap prices it otherwise,
  layers.py). u by link tier, Calculon's
  own system files (systems/a100_80g.json, h100_80g_nvl8.json): 0.15 on the node's NVLink, 0.02 across
  nodes (`PROCESSOR_USAGE`), the same for every row and every collective the stack overlaps.
Left out: stragglers, data loading, kernel launch gaps.
"""
import functools
import math

from labs.dims import ParallelDims
from labs.formulas import flops
from labs.formulas import schedules
from labs.formulas import links
from labs.formulas.planning import kernels, memory, offload, traffic
from labs.formulas.planning.software import RECOMPUTE, SCHEDULES

PROCESSOR_USAGE = {"node": 0.15, "network": 0.02}    # Calculon's u: NVLink group, across nodes
AXES = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp": ("dp", "cp")}
ONE_F_ONE_B = SCHEDULES.index("1f1b")


def node_counts(job, tp, pp, cp, ep, dp, dpr):
    """{group: nodes one of its groups touches} on a layout of these degrees (`links.group_nodes`);
    experts folded over tp x dp (Megatron-Core's ETP = 1) sit on consecutive ranks."""
    G = job.cluster.gpus_per_node
    d = ParallelDims(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, dp_replicate=dpr, fold_ep=job.software.folds(ep))
    out = {g: links.group_nodes(d, axis, G) for g, axis in AXES.items()}
    if job.software.ep_folding:
        out["ep"] = links.atom_nodes(1, d.ep, G)
    return out


class Pieces:
    """The pieces `micro_batch` and `step` combine, for one job and eta, each evaluated once per distinct
    key of small integers: the search prices a million candidates from far fewer pieces, and a key of
    integers hashes in a fraction of the time the job (a large frozen dataclass) would."""

    def __init__(self, job, eta):
        memo = functools.lru_cache(maxsize=None)
        self.job, self.eta = job, eta
        self.nodes = memo(functools.partial(node_counts, job))      # shared: not to be changed
        self.counts = memo(functools.partial(memory.stage_layer_counts, job.model))
        self.layer = memo(functools.partial(layer_cost, job, eta))
        self.head = memo(lambda tokens, tp: float(kernels.head_seconds(job.model, job.cluster, eta, job.fp8,
                                                                     tokens, tp)))
        self.vocab = memo(functools.partial(vocab_seconds, job))
        self.send = memo(functools.partial(send_seconds, job))
        self.data_parallel = memo(functools.partial(_data_parallel, job))
        self.bubble = memo(bubble)


def seconds(job, calls, ranks, nodes):
    """{group: seconds} of ``calls`` (`traffic.layer_calls` format): alpha and bytes (`links`) on a group
    of ``ranks[group]`` ranks over ``nodes[group]`` nodes (the intra-node link on one node)."""
    out = {}
    for group, op, payload, n in calls:
        out[group] = out.get(group, 0.0) + n * links.collective_time(op, payload, ranks[group], nodes[group],
                                                                     job.cluster)
    return out


def layer_cost(job, eta, moe, b, tp, cp, ep, sp, rc, tp_nodes, cp_nodes, ep_nodes, ep_chunks=None):
    """One layer of a kind (``moe``) on one micro-batch of b sequences: (forward, backward with its
    recomputation, exposed seconds of its tp, cp and ep collectives). A collective the stack overlaps
    hides under the layer's GEMMs (tp), its attention (cp) or the whole layer (ep: only where
    ``ep_chunks``, the micro-batches it is spread over, is given; `ep_overlap_chunks`)."""
    m, sw = job.model, job.software
    secs = kernels.layer_seconds(m, job.cluster, eta, job.fp8, job.eager, job.kernels, bool(moe),
                                 b * m.seq // cp, tp, ep, bool(sp), RECOMPUTE[rc], sw.attention,
                                 sw.permute_fusion, cp)
    lay = dict(zip(("forward", "backward", "recompute", "gemm", "attention"), map(float, secs.values())))
    calls = traffic.layer_calls(m, tp, cp, ep, b, m.seq, 2, RECOMPUTE[rc], bool(moe), bool(sp))
    t = seconds(job, calls, {"tp": tp, "cp": cp, "ep": ep}, {"tp": tp_nodes, "cp": cp_nodes, "ep": ep_nodes})
    hide = (lay["gemm"] * sw.tp_overlap, lay["attention"] * sw.cp_overlap,
            (lay["forward"] + lay["backward"]) * (ep_chunks is not None))
    return (lay["forward"], lay["backward"] + lay["recompute"]) + tuple(
        (exposed_ring if TP_CP_FILL == "ring" and g != "ep" else exposed)(t.get(g, 0.0), h, n, usage(k))
        for g, h, n, k in zip(("tp", "cp", "ep"), hide, (tp, cp, ep_chunks or math.inf),
                              (tp_nodes, cp_nodes, ep_nodes)))


def ep_overlap_chunks(job, c):
    """n_g of the experts' all-to-alls: the chunks they hide under over the chunks that run alone, or
    None where the stack cannot overlap them for candidate c. Megatron-Core's 1F1B overlap
    (`overlap_moe_expert_parallel_comm`, TransformerConfig at core_r0.14.0) asserts an interleaved
    schedule when pp > 1 and no full recomputation. Without a pipeline the first micro-batch's
    forward and the last one's backward run alone (combined_1f1b_schedule_for_no_pipelining: "no a2a
    overlapping"); interleaved, the warm-up's (p - 1) 2 + (v - 1) p + 1 virtual micro-batches of rank 0
    and as many of the cool-down's (schedules.py at core_r0.14.0), of its v m: n_g = v m / W."""
    sw = job.software
    if not sw.ep_overlap or RECOMPUTE[c.rc] == "full" or (c.pp > 1 and c.sched == ONE_F_ONE_B):
        return None
    alone = 1 if c.pp == 1 else (c.pp - 1) * 2 + (c.v - 1) * c.pp + 1
    return c.v * c.m / alone


def vocab_seconds(job, tp, tp_nodes, cp, b, first, last):
    """The vocabulary-parallel embedding's and loss's all-reduces (`traffic.vocab_calls`)."""
    m = job.model
    calls = traffic.vocab_calls(m, tp, cp, b, m.seq, 2, first, last)
    return seconds(job, calls, {"tp": tp}, {"tp": tp_nodes}).get("tp", 0.0)


def send_seconds(job, tp, pp_nodes, cp, b, sp):
    """One pipeline message (`traffic.pp_send_bytes`) to the next stage, on the node or across."""
    m = job.model
    payload = traffic.pp_send_bytes(m, tp, cp, b, m.seq, 2, None if sp else False)
    return links.collective_time("send", payload, 2, min(pp_nodes, 2), job.cluster)


def micro_batch(job, eta, c, nodes, pieces=None):
    """One micro-batch on candidate c's stage: {"forward", "backward", "tp", "cp", "ep", "pp", "compute",
    "t_mb"} ("tp" to "pp": exposed seconds of each group); ``pieces``: a `Pieces` of the job and eta to
    share between calls."""
    return micro_batches(job, eta, c, (c.stage,), nodes, pieces)[0]


def micro_batches(job, eta, c, stages, nodes, pieces=None):
    """`micro_batch` of candidate c on each of ``stages``, which share its layers' costs."""
    p = pieces or Pieces(job, eta)
    counts = [p.counts(c.pp, c.v, st) for st in stages]
    dense = p.layer(0, c.b, c.tp, c.cp, c.ep, c.sp, c.rc, nodes["tp"], nodes["cp"], nodes["ep"]) \
        if any(n > n_moe for n, n_moe in counts) else None
    moe = p.layer(1, c.b, c.tp, c.cp, c.ep, c.sp, c.rc, nodes["tp"], nodes["cp"], nodes["ep"],
                  ep_overlap_chunks(job, c)) \
        if any(n_moe for _, n_moe in counts) else None
    send = p.send(c.tp, nodes["pp"], c.cp, c.b, c.sp)
    # Megatron-LM overlaps the sends only in the interleaved schedule: without it "overlap_p2p_comm =
    # False" (megatron/training/arguments.py at f2e5db40) and 1F1B waits for each send (DualPipe hides them)
    hidden = job.software.pp_overlap and c.sched != ONE_F_ONE_B
    out = []
    for st, (n, n_moe) in zip(stages, counts):
        fwd = bwd = tp = cp = ep = 0.0
        # a kind of layer the stage does not hold adds nothing (it may not exist at all)
        for lay, count in ((dense, n - n_moe), (moe, n_moe)):
            if count:
                f, b, t, x, e = lay
                fwd, bwd, tp = fwd + count * f, bwd + count * b, tp + count * t
                cp, ep = cp + count * x, ep + count * e
        first, last = st == 0, st == c.pp - 1
        if last:
            bwd += p.head(c.b * job.model.seq // c.cp, c.tp)
        compute = fwd + bwd
        tp += p.vocab(c.tp, nodes["tp"], c.cp, c.b, first, last)
        pp = overlapped(traffic.pp_sends(st, c.pp, c.v) * send, compute * hidden, usage(nodes["pp"]))
        out.append({"forward": fwd, "backward": bwd, "tp": tp, "cp": cp, "ep": ep, "pp": pp,
                    "compute": compute, "t_mb": compute + tp + cp + ep + pp})
    return out


def usage(nodes):
    """Calculon's processor usage u of a collective on a group over ``nodes`` nodes (`PROCESSOR_USAGE`)."""
    return PROCESSOR_USAGE["node" if nodes <= 1 else "network"]


def overlapped(comm, window, u):
    """Seconds ``comm`` adds to a step when the stack hides it under ``window`` seconds of compute: what
    the window cannot cover, and the compute slowed by the share u the collective holds while both run
    (u min(comm, window), Calculon's convention)."""
    return max(0.0, comm - window) + u * min(comm, window)


# The fill charged to tensor and context parallelism's chunked overlaps. "pipe": one chunk of the
# shorter of comm and compute stays exposed, as in a pipelined overlap (TE's 4-way "pipeline" reduce-
# scatter). "ring": a ring that starts on the rank's own chunk, which needs no transfer, has none while
# comm <= compute (n - 1)/n (TE's ring exchange, PyTorch's async TP, ring attention; Calculon's ring
# schedule). The model keeps "pipe" for every stack; `labs.planning.trials` prices "ring".
TP_CP_FILL = "pipe"


def exposed_ring(comm, compute, chunks, u=0.0):
    """`exposed` for a ring that starts on the local chunk: only what (n - 1)/n of the compute cannot
    cover, with the overlapped compute slowed by u."""
    return max(0.0, comm - compute * (chunks - 1) / chunks) + u * min(comm, compute)


def exposed(comm, compute, chunks, u=0.0):
    """Seconds of ``comm`` not hidden under ``compute`` when the collective is cut into ``chunks``
    pipelined with the compute it feeds (TE's and async TP's chunked GEMMs, ring attention's steps):
    what the compute cannot cover, and one chunk's worth of the shorter of the two, the pipeline's fill,
    with the overlapped compute slowed by u (`overlapped`)."""
    return overlapped(comm, compute, u) + min(comm, compute) / chunks


def _data_parallel(job, tp, pp, cp, ep, dp, dpr, etp, dpn, v, zero, offloaded):
    """(reduce, gather, replica, one unit's gather, optimizer step) in seconds, first stage."""
    m, cl = job.model, job.cluster
    ranks = dp * cp
    shard, replicas = (ranks // dpr, dpr) if zero == 3 else (ranks, 1)
    calls = traffic.dp_bytes(m, tp, pp, ep, v, 0, zero, ranks, memory.expert_group(ranks, tp, ep, etp),
                             replicas, 2, job.software.reduce_bytes, etp)
    bw = cl.intra_bw if dpn == 1 else cl.inter_bw
    units = max(memory.stage_layer_counts(m, pp, v, 0)[0], 1)       # a bucket, or an FSDP unit, per layer
    if job.software.shard_unit == "weight":                          # DeepSpeed's hooks: one call per weight
        units *= sum(len(w.shape) == 2 for w in m.layer_weights(0))
    alpha = units * links.alpha("reduce_scatter", shard, max(1, dpn // replicas),
                                cl.link) if shard > 1 else 0.0
    reduce = calls["reduce"] / bw + alpha if shard > 1 else 0.0
    gather = calls["gather"] / bw + alpha if shard > 1 and zero else 0.0
    replica = calls["replica"] / cl.inter_bw + links.alpha("all_reduce", replicas,
                                                           replicas) if replicas > 1 else 0.0
    params = sum(memory.stage_params(m, tp, pp, ep, v, 0, etp)) / (shard if zero >= 1 else 1)
    opt = offload.optimizer_seconds(cl, params) if offloaded else offload.ADAM_BYTES * params / cl.hbm_bw
    return tuple(float(x) for x in (reduce, gather, replica, gather / units, opt))


def bubble(sched, pp, m, v):
    """Chapter 5's bubble over ideal time of schedule ``sched`` (an index of `SCHEDULES`)."""
    name = SCHEDULES[sched]
    return float(schedules.formula({"zero_bubble": "zb-h1"}.get(name, name), pp, m, v)["over_ideal"]) \
        if pp > 1 else 0.0


def step(job, eta, c, slowest, first, nodes, pieces=None):
    """Seconds per step of candidate c: {"step", "pipeline", "bubble", "dp", "optimizer"}; ``slowest``: the
    `micro_batch` of its slowest stage, ``first``: of its first stage; ``pieces``: as `micro_batch`'s."""
    p, sw, m = pieces or Pieces(job, eta), job.software, c.m
    reduce, gather, replica, unit, opt = p.data_parallel(c.tp, c.pp, c.cp, c.ep, c.dp, c.dpr, c.etp,
                                                         nodes["dp"], c.v, c.zero, c.offload)
    fwd, bwd, u = first["forward"], first["backward"], usage(nodes["dp"])
    reduced = overlapped(reduce + replica, bwd * sw.overlap_grad_reduce, u)
    if c.zero == 0:
        dp = reduced
    elif c.zero == 1:
        dp = reduced + overlapped(gather, fwd * sw.overlap_param_gather, u)
    elif c.zero == 2:
        # ZeRO-2 reduce-scatters every micro-batch's gradients: under the next micro-batch's forward and
        # backward while there is one (nothing waits for them before the optimizer step), the last under
        # its own
        each = overlapped(reduce + replica, (fwd + bwd) * sw.overlap_grad_reduce, u)
        dp = (m - 1) * each + reduced + overlapped(gather, fwd * sw.overlap_param_gather, u)
    else:
        dp = fsdp_seconds(sw, c, reduce, gather, replica, unit, first, u)
    bubble_ = p.bubble(c.sched, c.pp, m, c.v)
    pipeline = m * slowest["t_mb"] * (1 + bubble_)
    return {"step": pipeline + dp + opt, "pipeline": pipeline, "bubble": m * slowest["t_mb"] * bubble_,
            "dp": dp, "optimizer": opt}


def fsdp_seconds(sw, c, reduce, gather, replica, unit, first, u=0.0):
    """ZeRO-3 / FSDP's exposed seconds per step: per micro-batch, its gathers (two when it reshards
    after forward) and its reduce-scatter, less the compute prefetching hides them under, and the first
    unit's gather, which nothing hides; kept gathered, one gather and one reduction per step. A stack
    whose hooks gather again in the recomputed forward (`software.Software.regather_recompute`) pays a
    third gather per micro-batch under full recomputation: forward, recomputed forward, backward. ``u``:
    the compute slowed while the collectives run (`overlapped`)."""
    m, reshard = c.m, c.reshard == 1
    gathers = 3 if sw.regather_recompute and c.recompute == "full" else 2
    per_mb = gathers * gather + reduce if reshard else 0.0
    once_g, once_r = (0.0, 0.0 + replica) if reshard else (gather, reduce + replica)
    if not sw.prefetch:
        return m * per_mb + once_g + once_r
    per_step = m * (overlapped(per_mb, first["compute"], u) + (unit if reshard else 0.0))
    return per_step + overlapped(once_g, first["forward"], u) + \
        overlapped(once_r, first["backward"] * sw.overlap_grad_reduce, u)


def model_flops_per_token(model, recompute="none"):
    """The FLOPs a paper divides by: PaLM's count (chapter 1: 6 P_mm + 12 L h s, full attention),
    plus the recomputed forward when the paper counts it (Narayanan et al. 2021, eq. 3)."""
    per_token = flops.flops_per_token(model.matmul_params(), model.layers, model.attention_width,
                                        model.seq)["total"]
    extra = sum(flops.recompute_flops_per_token(model.block_matmul_params(i), 1, model.attention_width,
                                                  model.seq,
                                                  recompute) for i in range(model.layers))
    return per_token + extra
