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
  (Qi et al. 2023, Table 2, ZB-H1) (`schedules.formula`);
- data parallelism, on the first stage, the last to finish its backward (chapter 5): the gradient
  reduction under the last micro-batch's backward when overlapped (ZeRO-2's reduction of every other
  micro-batch under the next one's forward and backward), the updated weights' all-gather under the
  next forward; ZeRO-3 / FSDP gathers per micro-batch (twice when it reshards after
  forward), prefetched under compute where the stack prefetches, all but the first unit's;
- the optimizer step: Adam's bytes per parameter of the rank's shard at the memory's bandwidth, or
  in host memory under offload (`offload`).
Left out: stragglers, data loading, kernel launch gaps, and the slowdown of compute that shares the
GPU with a collective.
"""
import numpy as np

from labs.dims import ParallelDims
from labs.memory_budget import compute
from labs.formulas import schedules
from labs.formulas import links
from labs.planning import kernels, memory, offload, traffic
from labs.planning.grid import per_unique
from labs.planning.software import RECOMPUTE, SCHEDULES

AXES = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp": ("dp", "cp")}
TUPLE = ("tp", "pp", "cp", "ep", "dp", "dpr", "etp")


def node_counts(job, c):
    """{group: nodes one of its groups touches} per candidate (`links.group_nodes`); experts folded over
    tp x dp (Megatron-Core's ETP = 1) sit on consecutive ranks."""
    G = job.cluster.gpus_per_node

    def nodes(*degrees):
        d = ParallelDims(**dict(zip(("tp", "pp", "cp", "ep", "dp", "dp_replicate"), degrees[:-1])),
                         fold_ep=job.software.folds(degrees[3]))
        out = {g: links.group_nodes(d, axis, G) for g, axis in AXES.items()}
        if job.software.ep_folding:
            out["ep"] = links.atom_nodes(1, d.ep, G)
        return tuple(out.values())
    return dict(zip(AXES, per_unique(nodes, *(c[k] for k in TUPLE))))


def seconds(job, calls, ranks, nodes):
    """{group: seconds} of ``calls`` (`traffic.layer_calls` format): alpha and bytes (`links`) on a group
    of ``ranks[group]`` ranks over ``nodes[group]`` nodes (the intra-node link on one node)."""
    out = {}
    for group, op, payload, n in calls:
        out[group] = out.get(group, 0.0) + n * links.collective_time(op, payload, ranks[group], nodes[group],
                                                                     job.cluster)
    return out


def micro_batch(job, eta, c, nodes):
    """One micro-batch on each candidate's stage: {"t_mb", "compute", "forward", "backward", "tp",
    "cp", "ep", "pp"} (the last four: exposed seconds of each group)."""
    m, sw = job.model, job.software
    tokens = c["b"] * m.seq // c["cp"]
    n, n_moe = per_unique(lambda pp, v, st: memory.stage_layer_counts(m, pp, v, st), c["pp"], c["v"],
                          c["stage"])
    out = {k: np.zeros(len(c)) for k in ("forward", "backward", "tp", "cp", "ep", "pp")}
    for moe, count in ((0, n - n_moe), (1, n_moe)):
        if not count.any():
            continue
        lay = dict(zip(("forward", "backward", "recompute", "gemm", "attention"), per_unique(
            lambda T, tp, ep, sp, rc, cp: tuple(kernels.layer_seconds(
                m, job.cluster, eta, job.fp8, job.eager, job.kernels, bool(moe), T, tp, ep, bool(sp),
                                                                      RECOMPUTE[rc],
                sw.attention, sw.permute_fusion, cp).values()),
            tokens, c["tp"], c["ep"], c["sp"], c["rc"], c["cp"])))
        comm = per_unique(lambda tp, tpn, cp, cpn, ep, epn, b, rc, sp: _layer_groups(job, moe, tp, tpn, cp,
                                                                                     cpn, ep, epn,
                                                                                     b, rc, sp),
                          c["tp"], nodes["tp"], c["cp"], nodes["cp"], c["ep"], nodes["ep"], c["b"], c["rc"],
                          c["sp"])
        hide = {"tp": lay["gemm"] * sw.tp_overlap, "cp": lay["attention"] * sw.cp_overlap,
                "ep": (lay["forward"] + lay["backward"]) * sw.ep_overlap}
        chunks = {"tp": c["tp"], "cp": c["cp"], "ep": np.inf}
        out["forward"] += count * lay["forward"]
        out["backward"] += count * (lay["backward"] + lay["recompute"])
        for g, secs in zip(("tp", "cp", "ep"), comm):
            out[g] += count * exposed(secs, hide[g], chunks[g])
    last, first = c["stage"] == c["pp"] - 1, c["stage"] == 0
    head = per_unique(lambda T, tp: kernels.head_seconds(m, job.cluster, eta, job.fp8, T, tp), tokens,
                      c["tp"])
    out["backward"] += np.where(last, head, 0.0)
    out["compute"] = out["forward"] + out["backward"]
    vocab = per_unique(lambda tp, tpn, cp, b, f, l: seconds(job, traffic.vocab_calls(m, tp, cp, b, m.seq, 2,
                                                                                     f, l),
                                                            {"tp": tp}, {"tp": tpn}).get("tp", 0.0),
                       c["tp"], nodes["tp"], c["cp"], c["b"], first, last)
    send = per_unique(lambda tp, ppn, cp, b, sp: links.collective_time(
        "send", traffic.pp_send_bytes(m, tp, cp, b, m.seq, 2, None if sp else False), 2, min(ppn, 2),
                                                                       job.cluster),
        c["tp"], nodes["pp"], c["cp"], c["b"], c["sp"])
    out["tp"] += vocab
    out["pp"] = exposed_pp = traffic.pp_sends(c["stage"], c["pp"], c["v"]) * send
    # Megatron-LM overlaps the sends only in the interleaved schedule: without it "overlap_p2p_comm =
    # False" (megatron/training/arguments.py at f2e5db40) and 1F1B waits for each send (DualPipe hides them)
    hidden = sw.pp_overlap * (c["sched"] != SCHEDULES.index("1f1b"))
    out["pp"] = np.maximum(0.0, exposed_pp - out["compute"] * hidden)
    out["t_mb"] = out["compute"] + out["tp"] + out["cp"] + out["ep"] + out["pp"]
    return out


def exposed(comm, compute, chunks):
    """Seconds of ``comm`` not hidden under ``compute`` when the collective is cut into ``chunks``
    pipelined with the compute it feeds (TE's and async TP's chunked GEMMs, ring attention's steps):
    what the compute cannot cover, and one chunk's worth of the shorter of the two, the pipeline's fill."""
    return np.maximum(0.0, comm - compute) + np.minimum(comm, compute) / chunks


def _layer_groups(job, moe, tp, tpn, cp, cpn, ep, epn, b, rc, sp):
    m = job.model
    calls = traffic.layer_calls(m, tp, cp, ep, b, m.seq, 2, RECOMPUTE[rc], bool(moe), bool(sp))
    t = seconds(job, calls, {"tp": tp, "cp": cp, "ep": ep}, {"tp": tpn, "cp": cpn, "ep": epn})
    return t.get("tp", 0.0), t.get("cp", 0.0), t.get("ep", 0.0)


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
    return reduce, gather, replica, gather / units, opt


def step(job, eta, c, slowest, first, nodes):
    """Seconds per step of every candidate: {"step", "pipeline", "bubble", "dp", "optimizer"}; ``slowest``:
    the `micro_batch` of each candidate's slowest stage, ``first``: of its first stage."""
    sw, m = job.software, c["m"]
    reduce, gather, replica, unit, opt = per_unique(lambda *k: _data_parallel(job, *k), *(c[k]
                                                                                          for k in TUPLE),
                                                    nodes["dp"], c["v"], c["zero"], c["offload"])
    bubble = per_unique(lambda s, p, mm, v: schedules.formula({"zero_bubble": "zb-h1"}.get(SCHEDULES[s],
                                                                                           SCHEDULES[s]),
                                                              p, mm, v)["over_ideal"] if p > 1 else 0.0,
                        c["sched"], c["pp"], m, c["v"])
    fwd, bwd = first["forward"], first["backward"]
    reduced = np.maximum(0.0, reduce + replica - bwd * sw.overlap_grad_reduce)
    # ZeRO-2 reduce-scatters every micro-batch's gradients: under the next micro-batch's forward and
    # backward while there is one (nothing waits for them before the optimizer step), the last under its own
    each = np.maximum(0.0, reduce + replica - (fwd + bwd) * sw.overlap_grad_reduce)
    gathered = np.maximum(0.0, gather - fwd * sw.overlap_param_gather)
    dp = np.select([c["zero"] == 0, c["zero"] == 1, c["zero"] == 2],
                   [reduced, reduced + gathered, (m - 1) * each + reduced + gathered],
                   default=fsdp_seconds(sw, c, reduce, gather, replica, unit, first))
    pipeline = m * slowest["t_mb"] * (1 + bubble)
    return {"step": pipeline + dp + opt, "pipeline": pipeline, "bubble": m * slowest["t_mb"] * bubble,
            "dp": dp,
            "optimizer": opt}


def fsdp_seconds(sw, c, reduce, gather, replica, unit, first):
    """ZeRO-3 / FSDP's exposed seconds per step: per micro-batch, its gathers (two when it reshards
    after forward) and its reduce-scatter, less the compute prefetching hides them under, and the first
    unit's gather, which nothing hides; kept gathered, one gather and one reduction per step."""
    m, reshard = c["m"], c["reshard"] == 1
    per_mb = np.where(reshard, 2 * gather + reduce, 0.0)
    once_g, once_r = np.where(reshard, 0.0, gather), np.where(reshard, 0.0, reduce) + replica
    if not sw.prefetch:
        return m * per_mb + once_g + once_r
    per_step = m * (np.maximum(0.0, per_mb - first["compute"]) + np.where(reshard, unit, 0.0))
    return per_step + np.maximum(0.0, once_g - first["forward"]) + \
        np.maximum(0.0, once_r - first["backward"] * sw.overlap_grad_reduce)


def model_flops_per_token(model, recompute="none"):
    """The FLOPs a paper divides by: PaLM's count (chapter 1: 6 P_mm + 12 L h s, full attention),
    plus the recomputed forward when the paper counts it (Narayanan et al. 2021, eq. 3)."""
    per_token = compute.flops_per_token(model.matmul_params(), model.layers, model.attention_width,
                                        model.seq)["total"]
    extra = sum(compute.recompute_flops_per_token(model.block_matmul_params(i), 1, model.attention_width,
                                                  model.seq,
                                                  recompute) for i in range(model.layers))
    return per_token + extra
