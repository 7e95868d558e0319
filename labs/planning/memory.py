"""Chapter 14: what one rank of a layout holds, term by term, each from the chapter that derived it.

A layout (`Plan`) is the degrees dp x tp x pp x cp x ep (`labs.dims.ParallelDims`, which checks them
and orders the ranks [tp, cp, ep, pp, dp] fastest first: Llama 3's order with the expert group inside
the data-parallel one), the ZeRO stage, the recomputation policy, the micro-batch size b and the
virtual stages v (model chunks per rank, interleaved 1F1B), over chapter 5's stage split
(`stage_balance.stage_layers`).

Bytes of rank r (stage r of the pipeline), in the order the planner names an overflow:
- weights, gradients, optimizer state: the rank's parameters (`ModelShape` weights split by
  tp, experts by ep) times chapter 1's bytes per parameter for the recipe and ZeRO stage
  (`budget.state_bytes_per_param`) over the data-parallel group dp * cp (the experts' over
  dp * cp / ep); stage 3 is FSDP2, whose pieces are chapter 3's (fp32 shard 4, fp32 gradient 4,
  Adam 8: `distributed_optimizer.FSDP2_PIECES`);
- activations at the schedule's peak: chapter 5's `schedules.peak_chunks` chunk micro-batches of
  the rank's layers, each layer chapter 1's formula (`activations.gpt3_activation_bytes_per_layer`
  for a GPT block with scores written out, `llama_activation_terms` for a Llama block, with
  FlashAttention and, in production kernels, a fused SwiGLU: `fused_swiglu`) at s/cp tokens, with
  sequence parallelism (chapter 6) when the software has it;
- logits, on the last stage: chapter 1's `logits.tail_forward_peak_bytes` at V/tp (vocabulary-
  parallel head and loss, chapter 4);
- buffers: what is gathered for one layer at a time: FSDP2's bf16 unit and the next one (prefetch),
  sequence parallelism's all-gathered layer input, context parallelism's all-gathered K and V.
Left out: the CUDA context, the allocator's fragmentation, temporary workspaces of kernels.
"""
import functools
import math
from dataclasses import dataclass, replace

from labs.dims import ParallelDims
from labs.memory_budget import activations, budget, fused_swiglu, logits
from labs.pipeline import schedules
from labs.pipeline.stage_balance import stage_layers
from labs.zero import distributed_optimizer

TERMS = ("weights", "gradients", "optimizer", "activations", "logits", "buffers")
BF16 = 2


@dataclass(frozen=True)
class Plan:
    """A layout: the degrees (`labs.dims.ParallelDims`, checked there) and the settings of each rank."""
    dims: ParallelDims
    zero: int = 1            # 0: DDP, 1-2: ZeRO (chapter 3), 3: FSDP2
    recompute: str = "none"  # "none", "selective", "full" (chapter 9)
    micro_batch: int = 1     # b, sequences per micro-batch
    v: int = 1               # model chunks per rank; v > 1 is interleaved 1F1B (chapter 5)
    sp: bool = True          # sequence parallelism with tp > 1 (chapter 6; Megatron-LM from 2022)

    @property
    def schedule(self):
        return "interleaved" if self.v > 1 else "1f1b"

    def with_(self, **changes):
        return replace(self, **changes)


def local_numel(w, tp, ep, kv_heads=None):
    """Elements of weight ``w`` on one rank: tensor parallelism by its split (chapter 4: KV heads
    split when tp divides them, one per rank when tp is a multiple of them), experts 1/ep each."""
    rows = w.shape[0]
    if w.split in ("col", "vocab"):
        rows = -(-rows // tp)              # a vocabulary is padded to a multiple of tp (Megatron)
    elif w.split == "kv":
        rows = rows * max(kv_heads // tp, 1) // kv_heads
    numel = rows * math.prod(w.shape[1:])
    if w.split == "row":
        numel //= tp
    return w.copies * numel / ep if w.expert else w.copies * numel


def stage_weights(model, pp, v, stage):
    """The weights rank ``stage`` of a pipeline of pp ranks (v chunks each) holds: its layers, the
    embedding on the first, the final norm and the head on the last (a tied embedding: its copy
    there too, as Megatron keeps)."""
    layers = stage_layers(model.layers, pp, v)[stage]
    ws = [w for i in layers for w in model.layer_weights(i)]
    if stage == 0:
        ws += model.embedding_weights()
    if stage == pp - 1:
        ws += model.head_weights()
        if model.tied and pp > 1:
            ws += model.embedding_weights()[:1]
    return ws


def rank_params(model, plan, stage):
    """{"dense": elements, "expert": elements} this rank holds, before any ZeRO sharding."""
    d = plan.dims
    return dict(_rank_params(model, d.tp, d.pp, d.ep, plan.v, stage))


@functools.lru_cache(maxsize=None)
def _rank_params(model, tp, pp, ep, v, stage):
    out = {"dense": 0, "expert": 0}
    for w in stage_weights(model, pp, v, stage):
        out["expert" if w.expert else "dense"] += local_numel(w, tp, ep, model.kv_heads)
    return tuple(out.items())


@functools.lru_cache(maxsize=None)
def state_bytes(zero, n, recipe):
    """Bytes per parameter on a rank of a data-parallel group of n: chapter 1's ZeRO stages 0-2,
    chapter 3's FSDP2 pieces for stage 3, as weights / gradients / optimizer."""
    if zero == 3:
        pieces = distributed_optimizer.FSDP2_PIECES
        return {"weights": pieces["params"] / n, "gradients": pieces["grads"] / n,
                "optimizer": pieces["adam_moments"] / n}
    b = budget.state_bytes_per_param(zero, n, recipe)
    return {"weights": b["parameters"], "gradients": b["gradients"], "optimizer": b["optimizer_state"]}


KERNELS = ("materialized", "flash", "fused")   # scores written out / FlashAttention / and a fused SwiGLU


def layer_activation_bytes(model, plan, kernels, i):
    """One layer's activations for one micro-batch on one rank (chapter 1's formulas) under
    ``kernels``: "materialized" (the GPT-3 block, Korthikanti et al. 2022, or a Llama block with
    its scores written out), "flash" (FlashAttention, the SwiGLU op by op: the book's Llama block)
    or "fused" (FlashAttention and a fused SwiGLU, `fused_swiglu`)."""
    d = plan.dims
    return _layer_activation_bytes(model, kernels, model.is_moe_layer(i), plan.micro_batch, d.tp, d.cp,
                                   plan.recompute, plan.sp and d.tp > 1)


@functools.lru_cache(maxsize=None)
def _layer_activation_bytes(model, kernels, moe_layer, b, tp, cp, recompute, sp):
    s = model.seq // cp
    if model.mlp == "gelu":
        return activations.gpt3_activation_bytes_per_layer(s, b, model.hidden, model.heads, tp, sp, recompute)
    # an MoE layer: the SwiGLU activations of the k routed and the shared experts a token visits
    ffn = (model.top_k + model.shared_experts) * model.expert_ffn if moe_layer else model.ffn
    attention = "materialized" if kernels == "materialized" else "flash"
    terms = (fused_swiglu.llama_fused_mlp_terms if kernels == "fused" else activations.llama_activation_terms)(
        s, b, model.hidden, model.heads, model.kv_heads, ffn, tp, sp, recompute, attention)
    return sum(terms.values())


def activation_bytes(model, plan, kernels, stage, m):
    """Activations rank ``stage`` holds at its peak: chapter 5's peak chunk micro-batches times the
    layers of an average chunk, at the costliest layer's bytes."""
    d = plan.dims
    layers = stage_layers(model.layers, d.pp, plan.v)[stage]
    if not layers:
        return 0
    chunks = schedules.peak_chunks(plan.schedule, d.pp, m, plan.v, stage)
    sp = plan.sp and d.tp > 1
    per_layer = max(_layer_activation_bytes(model, kernels, model.is_moe_layer(i), plan.micro_batch, d.tp, d.cp,
                                            plan.recompute, sp) for i in _kinds(model, d.pp, plan.v, stage))
    return chunks * len(layers) / plan.v * per_layer


@functools.lru_cache(maxsize=None)
def _largest_layer(model, tp, pp, ep, v, stage):
    """Elements of the largest layer on this rank after the tp and ep split: FSDP2's unit."""
    return max((sum(local_numel(w, tp, ep, model.kv_heads) for w in model.layer_weights(i))
                for i in _kinds(model, pp, v, stage)), default=0)


@functools.lru_cache(maxsize=None)
def _kinds(model, pp, v, stage):
    """One layer of each kind (dense, MoE) on this rank: the formulas differ only by kind."""
    return tuple({model.is_moe_layer(i): i for i in stage_layers(model.layers, pp, v)[stage]}.values())


def rank_memory(model, plan, recipe, kernels, m, stage):
    """{term: bytes} of rank ``stage``, the six TERMS."""
    return dict(zip(TERMS, rank_memory_terms(model, plan, recipe, kernels, m, stage)))


def rank_memory_terms(model, plan, recipe, kernels, m, stage):
    """The six TERMS of rank ``stage`` as a tuple (the planner's inner loop: cached pieces, no dicts)."""
    d = plan.dims
    state = state_terms(model, d.tp, d.pp, d.ep, plan.v, stage, plan.zero, d.size(("dp", "cp")), recipe)
    acts = activation_bytes(model, plan, kernels, stage, m)
    tail = _logits(model, d.tp, d.cp, plan.micro_batch) if stage == d.pp - 1 else 0
    buffers = _buffers(model, plan.zero, d.tp, d.pp, d.cp, d.ep, plan.v, stage, plan.micro_batch, plan.sp)
    return state + (acts, tail, buffers)


@functools.lru_cache(maxsize=None)
def state_terms(model, tp, pp, ep, v, stage, zero, group, recipe):
    """Weights, gradients, optimizer state: the rank's parameters times chapter 1's (or, stage 3,
    chapter 3's FSDP2) bytes per parameter over the data-parallel group (dp cp; dp cp / ep for experts)."""
    params = dict(_rank_params(model, tp, pp, ep, v, stage))
    dense, expert = state_bytes(zero, group, recipe), state_bytes(zero, max(group // ep, 1), recipe)
    return tuple(params["dense"] * dense[t] + params["expert"] * expert[t] for t in ("weights", "gradients", "optimizer"))


@functools.lru_cache(maxsize=None)
def _logits(model, tp, cp, b):
    """The tail's forward peak on the last stage (chapter 1), vocabulary-parallel over tp (chapter 4)."""
    return logits.tail_forward_peak_bytes(model.seq // cp, b, -(-model.vocab // tp), BF16, target_copy=False)


@functools.lru_cache(maxsize=None)
def _buffers(model, zero, tp, pp, cp, ep, v, stage, b, sp):
    out = 0
    if zero == 3:             # the gathered bf16 unit being computed and the one prefetched (chapter 3)
        out += 2 * BF16 * _largest_layer(model, tp, pp, ep, v, stage)
    if tp > 1 and sp:         # sequence parallelism's all-gathered layer input (chapter 6)
        out += BF16 * b * (model.seq // cp) * model.hidden
    if cp > 1:                # all-gather CP: K and V of the whole sequence for one layer (chapter 6)
        out += 2 * BF16 * b * model.seq * model.kv_heads * model.head_dim // min(tp, model.kv_heads)
    return out


def overflow(mem, capacity):
    """The first term, in TERMS order, at which the running total passes ``capacity``; None if it
    fits. ``mem``: {term: bytes} or the tuple of `rank_memory_terms`."""
    total = 0
    for term, value in zip(TERMS, mem.values() if isinstance(mem, dict) else mem):
        total += value
        if total > capacity:
            return term
    return None
