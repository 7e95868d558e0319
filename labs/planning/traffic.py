"""Chapter 14: the bytes each parallel group sends per rank per step, and the link tier it uses.

Every count is a formula of an earlier chapter, for a ring collective of M bytes on n ranks: each
rank sends 2(n-1)/n of it for an all-reduce and (n-1)/n for an all-gather or a reduce-scatter (the
one table, `labs.measure.costs`; Patarasuk & Yuan 2009). These are formula bytes: what the
algorithms send, the same on NCCL and on gloo's rings; chapter 14's three-dimensional lab counts a
tiny run's messages against them.

Which tier a group uses: chapter 11's group-by-group rule (`ParallelDims.tier`), with the ranks
ordered [tp, cp, ep, pp, dp] fastest first.
"""
import functools

from labs.context_parallel import allgather_cp, sequence_parallel
from labs.expert_parallel import moe_routing
from labs.measure import costs
from labs.pipeline.stage_balance import stage_layers
from labs.planning import memory

FP32 = 4
_ring = costs.sent


def predict_bytes_per_group(model, layout, micro_batch=None, num_microbatches=1, seq=None, dtype_bytes=2,
                            stage=0, grad_bytes=None, vocab_parallel=True, sequence_parallel_pp=None):
    """Bytes rank ``stage`` of ``layout`` (a `memory.Plan`) sends per optimizer step in each group:
    {"dp", "tp", "pp", "cp", "ep"}, plus "terms", each line's calls and bytes.

    Symbols: b = micro_batch (default layout.micro_batch), m = num_microbatches, s = seq (default
    model.seq), h = model.hidden, e = dtype_bytes (activations and weights), e_g = grad_bytes
    (gradients; default e), t = tp, c = cp, L_r = the layers of this stage (`stage_layers`),
    P_r = its parameters after the tp and ep split (`memory.rank_params`), M = b (s/c) h e.

    TP (chapter 4; chapter 6 for sequence parallelism, same bytes): per layer and micro-batch two
    all-reduces forward and two backward of M, 2 * 2(t-1)/t M each way, `sequence_parallel.
    forward_bytes_per_layer`; full recomputation (chapter 9) reruns the forward's two. With
    ``vocab_parallel`` (chapter 4's `vocab_parallel`): the first stage all-reduces the embedding's
    output (M) in forward; the last all-reduces the head's input gradient (M) in backward and the
    loss's three (b, s/c) fp32 vectors (max, target logit, sum of exponentials) in forward.
    PP (chapter 5): per micro-batch and model chunk one activation forward and one gradient back,
    M / t when the activation is split over the tp ranks (sequence parallelism, or Megatron's
    scatter/gather, Narayanan et al. 2021, §4.1; ``sequence_parallel_pp``, default t > 1); the last
    stage sends no activation from its last chunk, the first no gradient from its first: (v - [r = p-1])
    m forward and (v - [r = 0]) m backward. A tied embedding with p > 1 adds Megatron's all-reduce
    of its gradient between the first and last stages: M_E = (V/t) h e_g on 2 ranks.
    DP (chapters 2 and 3), over n = dp c ranks for the dense parameters and dp c / ep for the
    experts', once per step: stage 0 all-reduces P_r e_g; stage 1 reduce-scatters P_r e_g and
    all-gathers P_r e; stage 2 reduce-scatters every micro-batch (m times) and all-gathers once;
    stage 3 (FSDP2) all-gathers twice (forward, backward) and reduce-scatters every micro-batch
    (chapter 3's 3A/2 and (A+1)/2 times DDP under accumulation).
    CP (chapter 6, all-gather CP as Llama 3): per layer and micro-batch, K and V of b (s/c) k_r d e
    each (k_r the KV heads on this rank) all-gathered forward and reduce-scattered backward,
    `allgather_cp.allgather_bytes`; full recomputation gathers again.
    EP (chapter 7): per MoE layer and micro-batch, dispatch and combine, forward and backward, each
    `moe_routing.dispatch_bytes` of the rank's b s / (c t) tokens with top-k; full recomputation
    repeats the forward's two.
    """
    b, d = micro_batch or layout.micro_batch, layout.dims
    m, s, e = num_microbatches, seq or model.seq, dtype_bytes
    per_mb = micro_batch_bytes(model, d.tp, d.pp, d.cp, d.ep, layout.v, b, layout.recompute,
                               stage, s, e, vocab_parallel, sequence_parallel_pp)
    terms = {k: m * v for k, v in per_mb.items()}
    p, t = d.pp, d.tp
    tied = model.tied and p > 1 and stage in (0, p - 1)
    e_g = grad_bytes or e
    terms["pp_tied_embedding"] = _ring("all_reduce", -(-model.vocab // t) * model.hidden * e_g, 2) if tied else 0
    calls = dp_calls(model, layout, stage, e, e_g)
    terms["dp"] = {0: calls["reduce"], 1: calls["reduce"] + calls["gather"], 2: m * calls["reduce"] + calls["gather"],
                   3: m * (calls["reduce"] + 2 * calls["gather"])}[layout.zero]
    return {"tp": terms["tp_layers"] + terms["tp_vocab"], "pp": terms["pp_activations"] + terms["pp_tied_embedding"],
            "dp": terms["dp"], "cp": terms["cp"], "ep": terms["ep"], "terms": terms}


@functools.lru_cache(maxsize=None)
def micro_batch_bytes(model, t, p, c, ep, v, b, recompute, stage, s, e, vocab_parallel=True, sequence_parallel_pp=None):
    """The TP, PP, CP and EP bytes of one micro-batch on rank ``stage`` (the terms above for m = 1)."""
    layers = stage_layers(model.layers, p, v)[stage]
    full = recompute == "full"
    M = b * (s // c) * model.hidden * e
    out = {}
    per_layer = sequence_parallel.forward_bytes_per_layer(b, s // c, model.hidden, t, e)["tp"] if t > 1 else 0
    out["tp_layers"] = len(layers) * per_layer * (3 if full else 2)
    vocab = 0
    if vocab_parallel and t > 1:
        if stage == 0:
            vocab += _ring("all_reduce", M, t)
        if stage == p - 1:
            vocab += _ring("all_reduce", M, t) + 3 * _ring("all_reduce", b * (s // c) * FP32, t)
    out["tp_vocab"] = vocab
    split_pp = t > 1 if sequence_parallel_pp is None else sequence_parallel_pp
    sends = (v - (stage == p - 1)) + (v - (stage == 0)) if p > 1 else 0
    out["pp_activations"] = sends * (M // t if split_pp else M)
    kv_block = b * (s // c) * max(model.kv_heads // t, 1) * model.head_dim * e
    cp_layer = sum(allgather_cp.allgather_bytes(kv_block, c).values()) if c > 1 else 0
    out["cp"] = len(layers) * cp_layer * (1.5 if full else 1)
    moe_layers = sum(model.is_moe_layer(i) for i in layers)
    per_call = moe_routing.dispatch_bytes(b * s // (c * t), model.top_k, ep, model.hidden, e) if model.moe else 0
    out["ep"] = moe_layers * per_call * (6 if full else 4)
    return out


@functools.lru_cache(maxsize=None)
def dp_calls(model, layout, stage, dtype_bytes=2, grad_bytes=None):
    """Bytes rank ``stage`` sends in one gradient reduction (an all-reduce under DDP, a reduce-scatter
    under ZeRO) and in one all-gather of the weights (ZeRO), over its data-parallel groups: dp * cp
    ranks for the dense parameters, dp * cp / ep for the experts'."""
    params, d = memory.rank_params(model, layout, stage), layout.dims
    e_g = grad_bytes or dtype_bytes
    out = {"reduce": 0, "gather": 0}
    for kind, n in (("dense", d.size(("dp", "cp"))), ("expert", d.size(("edp", "cp")))):
        out["reduce"] += _ring("all_reduce" if layout.zero == 0 else "reduce_scatter", params[kind] * e_g, n)
        out["gather"] += _ring("all_gather", params[kind] * dtype_bytes, n) if layout.zero else 0
    return out


@functools.lru_cache(maxsize=None)
def tiers(dims, gpus_per_node):
    """{group: "intra" or "inter"} by chapter 11's group-by-group rule (`ParallelDims.tier`): tp, cp,
    ep, pp, and dp, the data-parallel group of the gradient reduction (dp x cp ranks)."""
    out = {a: dims.tier(a, gpus_per_node) for a in ("tp", "cp", "ep", "pp")}
    out["dp"] = dims.tier(("dp", "cp"), gpus_per_node)
    return out
