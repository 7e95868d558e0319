"""Chapter 14: the estimated step time of a layout, and the FLOPs it is measured against.

    step = m t_max (1 + bubble) + exposed data-parallel time

- t_max: the slowest stage's time for one micro-batch: its executed FLOPs at a calibrated fraction
  eta of the GPU's peak, plus the tensor-, context-, expert- and pipeline-parallel bytes of that
  micro-batch at their link tier's bandwidth (`traffic`), all on the critical path: TP's
  all-reduces sit between a layer's matmuls (chapter 4), Llama 3's all-gather CP is "exposed in
  the critical path" (Llama Team 2024, §3.3.2), and no chapter measured the overlap of an
  all-to-all or of a pipeline send with compute;
- the FLOPs a stage executes: chapter 1's per-token count (`compute.flops_per_token`, forward and
  backward of each layer's active matmul weights and attention, the head on the last stage) plus
  recomputation (`compute.recompute_flops_per_token`), attention halved when a fused causal kernel
  skips the masked half (chapter 1), per token of the micro-batch's b s / cp tokens, over tp;
- bubble: chapter 5's bubble over ideal time, (p-1)/m for 1F1B and (p-1)/(v m) interleaved
  (`schedules.formula`, Narayanan et al. 2021, §2.2);
- data parallelism: the gradient reduction overlaps the last micro-batch's backward on the stage,
  as chapter 2's buckets start inside backward and chapter 5 derived for a pipeline's stages; what
  backward cannot hide is exposed, and so is ZeRO's all-gather of the updated weights after the
  optimizer step (stages 1, 2) and FSDP2's gathers of every micro-batch (stage 3: chapter 3's
  hand FSDP does not prefetch, so no chapter measured that overlap).
Left out: the optimizer step's memory-bound arithmetic, latencies (alpha), stragglers, data loading.
"""
import functools

from labs.memory_budget import compute
from labs.pipeline import schedules
from labs.pipeline.stage_balance import stage_layers
from labs.planning import traffic


def layer_flops(model, i, seq, recompute, causal):
    """FLOPs per token of layer ``i``: (executed with the causal kernel's skip, model count without)."""
    p = model.block_matmul_params(i)
    run = compute.flops_per_token(p, 1, model.attention_width, seq, causal)["total"]
    return run + compute.recompute_flops_per_token(p, 1, model.attention_width, seq, recompute)


def stage_flops(model, plan, stage, kernels):
    """FLOPs this rank executes for one micro-batch, forward and backward: {"total", "backward"}."""
    d = plan.dims
    per_token, forward = _stage_flops_per_token(model, d.pp, plan.v, stage, plan.recompute, kernels)
    tokens = plan.micro_batch * model.seq / d.cp
    total = tokens * per_token / d.tp
    return {"total": total, "backward": total - tokens * forward / d.tp}


@functools.lru_cache(maxsize=None)
def _stage_flops_per_token(model, pp, v, stage, recompute, kernels):
    layers = stage_layers(model.layers, pp, v)[stage]
    causal = kernels != "materialized"   # a fused attention kernel skips the masked half
    per_token = sum(layer_flops(model, i, model.seq, recompute, causal) for i in layers)
    forward = sum(compute.flops_per_token(model.block_matmul_params(i), 1, model.attention_width, model.seq,
                                          causal)["forward"] for i in layers)
    if stage == pp - 1:   # the output layer, 2hV forward and 4hV backward, never recomputed
        head = compute.flops_per_token(model.hidden * model.vocab, 1, model.hidden, model.seq)["matmul"]
        per_token += head
        forward += head / 3
    return per_token, forward


def model_flops_per_token(model, recompute="none"):
    """The FLOPs a paper divides by: PaLM's count (chapter 1: 6 P_mm + 12 L h s, full attention),
    plus the recomputed forward when the paper counts it (Narayanan et al. 2021, eq. 3)."""
    per_token = compute.flops_per_token(model.matmul_params(), model.layers, model.attention_width, model.seq)["total"]
    extra = sum(compute.recompute_flops_per_token(model.block_matmul_params(i), 1, model.attention_width, model.seq,
                                                  recompute) for i in range(model.layers))
    return per_token + extra


def step_time(model, cluster, plan, m, eta, kernels="fused", grad_bytes=2):
    """Seconds per step and its parts: {"step", "compute", "bubble", "exposed_comm", "dp_exposed",
    "t_max", "slowest_stage", "tiers", "bytes"}. ``eta``: the calibrated matmul efficiency."""
    pipe = _pipeline(model, cluster, plan.with_(zero=0), m, eta, kernels)   # the same for every ZeRO stage
    tiers = traffic.tiers(plan.dims, cluster.gpus_per_node)
    bw = cluster.intra_bw if tiers["dp"] == "intra" else cluster.inter_bw
    dp = _dp_exposed(model, plan, m, bw, pipe["backward_mb"], grad_bytes)
    return {"step": pipe["pipe"] + dp, "compute": m * pipe["compute_mb"], "exposed_comm": m * pipe["comm_mb"],
            "bubble": m * pipe["t_mb"] * pipe["bubble"], "dp_exposed": dp, "t_max": pipe["t_mb"],
            "slowest_stage": pipe["stage"], "tiers": tiers, "bytes": pipe["bytes"]}


@functools.lru_cache(maxsize=None)
def _pipeline(model, cluster, plan, m, eta, kernels):
    """The slowest stage's micro-batch (compute and the TP, CP, EP, PP bytes at their tiers) and the
    pipeline's m t_max (1 + bubble)."""
    d = plan.dims
    tiers = traffic.tiers(d, cluster.gpus_per_node)
    bw = {g: cluster.intra_bw if tier == "intra" else cluster.inter_bw for g, tier in tiers.items()}
    best = None
    for stage in _stages(d.pp):
        f = stage_flops(model, plan, stage, kernels)
        sent = traffic.micro_batch_bytes(model, d.tp, d.pp, d.cp, d.ep, plan.v, plan.micro_batch,
                                         plan.recompute, stage, model.seq, 2)
        comm = sum(sent[k] / bw[k.split("_")[0]] for k in sent)
        t = f["total"] / (cluster.peak_flops * eta)
        if best is None or t + comm > best["t_mb"]:
            best = {"t_mb": t + comm, "compute_mb": t, "comm_mb": comm, "stage": stage, "bytes": sent,
                    "backward_mb": f["backward"] / (cluster.peak_flops * eta)}
    best["bubble"] = schedules.formula(plan.schedule, d.pp, m, plan.v)["over_ideal"] if d.pp > 1 else 0.0
    best["pipe"] = m * best["t_mb"] * (1 + best["bubble"])
    return best


def _stages(pp):
    """The stages that can be slowest: the first (embedding), a full middle one and the last (head)."""
    return sorted({0, pp // 2, pp - 1})


def _dp_exposed(model, plan, m, bw, backward_s, grad_bytes):
    """Data-parallel seconds the pipeline cannot hide (see the module docstring), on stage 0, the
    last to finish its backward (chapter 5)."""
    calls = traffic.dp_calls(model, plan, 0, 2, grad_bytes)
    hidden_reduce = max(0.0, calls["reduce"] / bw - backward_s)
    gather = calls["gather"] / bw
    return {0: hidden_reduce, 1: hidden_reduce + gather, 2: m * hidden_reduce + gather,
            3: m * (hidden_reduce + 2 * gather)}[plan.zero]
