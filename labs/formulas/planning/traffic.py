"""Chapter 14: the collectives each parallel group runs per micro-batch and per step, and their bytes.

Every count is a formula of an earlier chapter, for a ring collective of M bytes on n ranks: each
rank sends 2(n-1)/n of it for an all-reduce and (n-1)/n for an all-gather, a reduce-scatter or an
all-to-all (the one table, `labs.formulas.costs`; Patarasuk & Yuan 2009). These are formula bytes:
what the algorithms send, the same on NCCL and on gloo's rings; chapter 14's three-dimensional lab
counts a tiny run's messages against them. `layer_calls` lists the calls themselves (group, op,
payload, how many), so `timing` can charge each one NCCL's latency as well as its bytes
(`links`); `micro_batch_bytes` and `predict_bytes_per_group` add up their bytes.

Which tier a group uses: chapter 11's group-by-group rule (`ParallelDims.tier`), with the ranks
ordered [tp, cp, ep, pp, dp] fastest first.
"""
import functools

from labs.formulas import costs
from labs.formulas.stages import stage_layers
from labs.formulas.planning import memory

FP32 = 4
_ring = costs.sent


@functools.lru_cache(maxsize=None)
def layer_calls(model, t, c, ep, b, s, e, recompute, moe_layer, sp=True):
    """The collectives of one layer for one micro-batch on one rank: ((group, op, payload, calls), ...).

    TP (chapter 4; chapter 6 for sequence parallelism, same bytes): two all-reduces of M = b (s/c) h e
    forward and two backward, or under sequence parallelism two all-gathers and two reduce-scatters
    each way; full recomputation (chapter 9) reruns the forward's. CP (chapter 6, all-gather CP as
    Llama 3): K and V of b (s/c) k_r d e each (k_r the KV heads on this rank) all-gathered forward and
    reduce-scattered backward, gathered again under full recomputation. EP (chapter 7): dispatch and
    combine forward and backward, of the rank's b s / (c t) tokens times top-k, repeated forward
    under full recomputation."""
    full = recompute == "full"
    M = b * (s // c) * model.hidden * e
    out = []
    if t > 1:
        n = 3 if full else 2
        out += [("tp", "all_gather", M, 2 * n), ("tp", "reduce_scatter", M, 2 * n)] if sp else \
               [("tp", "all_reduce", M, 2 * n)]
    if c > 1:
        kv = b * (s // c) * max(model.kv_heads // t, 1) * model.head_dim * e * c    # the gathered K (or V)
        out += [("cp", "all_gather", kv, 4 if full else 2), ("cp", "reduce_scatter", kv, 2)]
    if moe_layer and ep > 1:
        out += [("ep", "all_to_all", b * s // (c * t) * model.top_k * model.hidden * e, 6 if full else 4)]
    return tuple(out)


@functools.lru_cache(maxsize=None)
def stage_calls(model, t, c, b, s, e, stage, p, v, vocab_parallel=True, sequence_parallel_pp=None):
    """The collectives of one micro-batch outside the layers on rank ``stage``: the vocabulary-parallel
    embedding and loss (`vocab_calls`) and the pipeline's sends (`pp_sends` of `pp_send_bytes`)."""
    out = list(vocab_calls(model, t, c, b, s, e, stage == 0, stage == p - 1) if vocab_parallel else ())
    sends = pp_sends(stage, p, v)
    if sends:
        out.append(("pp", "send", pp_send_bytes(model, t, c, b, s, e, sequence_parallel_pp), sends))
    return tuple(out)


def vocab_calls(model, t, c, b, s, e, first, last):
    """Chapter 4's `vocab_parallel`: the first stage all-reduces the embedding's output, M = b (s/c) h e;
    the last all-reduces the head's input gradient, M, and the loss's three (b, s/c) fp32 vectors."""
    M, out = b * (s // c) * model.hidden * e, []
    if t > 1 and first:
        out.append(("tp", "all_reduce", M, 1))
    if t > 1 and last:
        out += [("tp", "all_reduce", M, 1), ("tp", "all_reduce", b * (s // c) * FP32, 3)]
    return tuple(out)


def pp_sends(stage, p, v):
    """Pipeline sends per micro-batch on rank ``stage`` (chapter 5): per model chunk one activation
    forward and one gradient back; the last stage sends no activation from its last chunk, the first
    no gradient from its first."""
    return (v - (stage == p - 1)) + (v - (stage == 0)) if p > 1 else 0


def pp_send_bytes(model, t, c, b, s, e, sequence_parallel_pp=None):
    """One pipeline message: M / t when the activation is split over the tp ranks (sequence
    parallelism, or Megatron's scatter/gather, Narayanan et al. 2021, §4.1; ``sequence_parallel_pp``,
    default t > 1), M = b (s/c) h e otherwise."""
    M = b * (s // c) * model.hidden * e
    split = t > 1 if sequence_parallel_pp is None else sequence_parallel_pp
    return M // t if split else M


def group_sizes(dims):
    """Ranks in each group the calls name (the data-parallel ones are `dp_calls`')."""
    return {"tp": dims.tp, "cp": dims.cp, "ep": dims.ep, "pp": 2}


def sent_bytes(calls, sizes):
    """{group: formula bytes one rank sends} for ``calls`` on groups of ``sizes``."""
    out = {}
    for group, op, payload, n in calls:
        out[group] = out.get(group, 0) + n * _ring(op, payload, sizes[group])
    return out


@functools.lru_cache(maxsize=None)
def micro_batch_bytes(model, t, p, c, ep, v, b, recompute, stage, s, e, vocab_parallel=True,
                      sequence_parallel_pp=None):
    """The TP, PP, CP and EP bytes of one micro-batch on rank ``stage``: {"tp_layers", "tp_vocab",
    "pp_activations", "cp", "ep"}."""
    layers = stage_layers(model.layers, p, v)[stage]
    sizes = {"tp": t, "cp": c, "ep": ep, "pp": 2}
    per_layer = {kind: sent_bytes(layer_calls(model, t, c, ep, b, s, e, recompute, kind), sizes)
                 for kind in (0, 1)}
    n_moe = sum(model.is_moe_layer(i) for i in layers)
    total = {g: (len(layers) - n_moe) * per_layer[0].get(g, 0) + n_moe * per_layer[1].get(g, 0)
             for g in ("tp", "cp", "ep")}
    outside = sent_bytes(stage_calls(model, t, c, b, s, e, stage, p, v, vocab_parallel, sequence_parallel_pp),
                         sizes)
    return {"tp_layers": total["tp"], "tp_vocab": outside.get("tp", 0), "pp_activations": outside.get("pp",
                                                                                                      0),
            "cp": total["cp"], "ep": total["ep"]}


def predict_bytes_per_group(model, layout, micro_batch=None, num_microbatches=1, seq=None, dtype_bytes=2,
                            stage=0, grad_bytes=None, vocab_parallel=True, sequence_parallel_pp=None):
    """Bytes rank ``stage`` of ``layout`` (a `memory.Plan`) sends per optimizer step in each group:
    {"dp", "tp", "pp", "cp", "ep"}, plus "terms", each line's bytes: m micro-batches of
    `micro_batch_bytes`, a tied embedding's gradient all-reduce between the first and last stages
    (Megatron's, M_E = (V/t) h e_g on 2 ranks), and the data-parallel calls of `dp_calls` (stage 0:
    one all-reduce; 1: reduce-scatter and all-gather; 2: a reduce-scatter per micro-batch; 3, FSDP2:
    two all-gathers and a reduce-scatter per micro-batch: chapter 3's 3A/2 and (A+1)/2 times DDP)."""
    b, d = micro_batch or layout.micro_batch, layout.dims
    m, s, e = num_microbatches, seq or model.seq, dtype_bytes
    per_mb = micro_batch_bytes(model, d.tp, d.pp, d.cp, d.ep, layout.v, b, layout.recompute,
                               stage, s, e, vocab_parallel, sequence_parallel_pp)
    terms = {k: m * v for k, v in per_mb.items()}
    p, t = d.pp, d.tp
    tied = model.tied and p > 1 and stage in (0, p - 1)
    e_g = grad_bytes or e
    terms["pp_tied_embedding"] = _ring("all_reduce", -(-model.vocab // t) * model.hidden * e_g,
                                       2) if tied else 0
    calls = dp_calls(model, layout, stage, e, e_g)
    terms["dp"] = {0: calls["reduce"], 1: calls["reduce"] + calls["gather"], 2: m * calls["reduce"]
                   + calls["gather"],
                   3: m * (calls["reduce"] + 2 * calls["gather"])}[layout.zero]
    return {"tp": terms["tp_layers"] + terms["tp_vocab"], "pp": terms["pp_activations"]
            + terms["pp_tied_embedding"],
            "dp": terms["dp"], "cp": terms["cp"], "ep": terms["ep"], "terms": terms}


def dp_calls(model, layout, stage, dtype_bytes=2, grad_bytes=None):
    """Bytes rank ``stage`` sends in one gradient reduction (an all-reduce under DDP, a reduce-scatter
    under ZeRO) and in one all-gather of the weights (ZeRO), over its data-parallel groups: dp * cp
    ranks for the dense parameters, dp * cp / ep for the experts' (HSDP: the shard group; its
    replicas all-reduce their shard once more, "replica")."""
    d = layout.dims
    dense = d.size(("dp", "cp"))
    return dp_bytes(model, d.tp, d.pp, d.ep, layout.v, stage, layout.zero, dense,
                    memory.expert_group(dense, d.tp, d.ep, d.etp), d.dp_replicate if layout.zero == 3 else 1,
                    dtype_bytes, grad_bytes, d.etp)


@functools.lru_cache(maxsize=None)
def dp_bytes(model, tp, pp, ep, v, stage, zero, n_dense, n_expert, replicas=1, dtype_bytes=2,
             grad_bytes=None, etp=None):
    """`dp_calls` from the group sizes: n_dense ranks hold the same dense weights, n_expert the same
    experts; ``replicas``: HSDP's replicas of each shard group; ``etp``: the experts' tensor-parallel
    degree (`memory.local_numel`)."""
    params = dict(zip(("dense", "expert"), memory.stage_params(model, tp, pp, ep, v, stage, etp)))
    e_g = grad_bytes or dtype_bytes
    out = {"reduce": 0, "gather": 0, "replica": 0}
    for kind, n in (("dense", n_dense), ("expert", n_expert)):
        n_shard = n // replicas
        out["reduce"] += _ring("all_reduce" if zero == 0 else "reduce_scatter", params[kind] * e_g, n_shard)
        out["gather"] += _ring("all_gather", params[kind] * dtype_bytes, n_shard) if zero else 0
        out["replica"] += _ring("all_reduce", params[kind] * e_g / n_shard, replicas)
    return out


@functools.lru_cache(maxsize=None)
def tiers(dims, gpus_per_node):
    """{group: "intra" or "inter"} by chapter 11's group-by-group rule (`ParallelDims.tier`): tp, cp,
    ep, pp, and dp, the data-parallel group of the gradient reduction (dp x cp ranks)."""
    out = {a: dims.tier(a, gpus_per_node) for a in ("tp", "cp", "ep", "pp")}
    out["dp"] = dims.tier(("dp", "cp"), gpus_per_node)
    return out
