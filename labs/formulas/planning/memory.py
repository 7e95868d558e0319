"""Chapter 14: what one rank of a layout holds, term by term, each from the chapter that derived it.

A layout (`Plan`) is the degrees dp x tp x pp x cp x ep (`labs.dims.ParallelDims`, which checks them
and orders the ranks [tp, cp, ep, pp, dp] fastest first: Llama 3's order with the expert group inside
the data-parallel one; HSDP splits dp into dp_replicate x dp_shard), the ZeRO stage, the
recomputation policy, the micro-batch size b, the virtual stages v (model chunks per rank,
interleaved 1F1B) and whether the optimizer state lives in host memory, over chapter 5's stage split
(`stage_balance.stage_layers`).

Bytes of rank r (stage r of the pipeline), in the order the planner names an overflow:
- weights, gradients, optimizer state: the rank's parameters (`ModelShape` weights split by tp,
  experts by ep) times chapter 1's bytes per parameter for the recipe and ZeRO stage
  (`state_bytes_per_param`) over the data-parallel group dp * cp (the experts' over
  dp * cp / ep); stage 3 is FSDP2, whose pieces are chapter 3's (fp32 shard 4, fp32 gradient 4,
  Adam 8: `FSDP2_PIECES`) over dp_shard * cp; with the optimizer offloaded
  (ZeRO-Offload, Ren et al. 2021) the GPU keeps the 16-bit weights only, the gradients streaming to
  the host as they are reduced (`offload`);
- activations at the schedule's peak: chapter 5's `schedules.peak_chunks` chunk micro-batches of
  the rank's layers, each layer chapter 1's formula (`activations`) at s/cp tokens, with sequence
  parallelism (chapter 6) when the software has it; under recomputation, plus one layer's full
  activations, rebuilt in backward (full recomputation every k layers: one input per k layers kept,
  k layers rebuilt at once);
- logits, on the last stage: chapter 1's `activations.tail_forward_peak_bytes` at V/tp (vocabulary-
  parallel head and loss, chapter 4);
- buffers: FSDP2's gathered bf16 unit and the next one (prefetch) with the unit's unsharded
  gradient, or, when the weights stay gathered after forward (torchtitan under pipelining), the
  stage's gathered weights and gradients; sequence parallelism's gathered layer input; context
  parallelism's gathered K and V.
Left out: the CUDA context, the allocator's fragmentation, temporary workspaces of kernels.
"""
import functools
import math
from dataclasses import dataclass, replace

from labs.dims import ParallelDims
from labs.formulas import activations
from labs.formulas.memory import state_bytes_per_param
from labs.formulas.zero import FSDP2_PIECES
from labs.formulas import schedules
from labs.formulas.stages import stage_layers
from labs.formulas.planning.grid import Candidate
from labs.formulas.planning.software import RECOMPUTE

TERMS = ("weights", "gradients", "optimizer", "activations", "logits", "buffers")
KERNELS = ("materialized", "flash", "fused")   # scores written out / FlashAttention / and a fused SwiGLU
BF16 = 2


@dataclass(frozen=True)
class Plan:
    """A layout: the degrees (`labs.dims.ParallelDims`, checked there) and the settings of each rank."""
    dims: ParallelDims
    zero: int = 1            # 0: DDP, 1-2: ZeRO (chapter 3), 3: FSDP2
    recompute: str = "none"  # `software.RECOMPUTE` (chapter 9)
    micro_batch: int = 1     # b, sequences per micro-batch
    v: int = 1               # model chunks per rank; v > 1 is interleaved 1F1B (chapter 5)
    sp: bool = True          # sequence parallelism with tp > 1 (chapter 6; Megatron-LM from 2022)
    zero_bubble: bool = False   # a zero-bubble schedule (DeepSeek's; `timing`)
    offload: bool = False    # optimizer state and its step in host memory (`offload`)
    reshard: bool = True     # FSDP frees gathered weights after forward
    checkpoint_every: int = 1   # full recomputation keeps the input of every k-th layer (Megatron's uniform)

    @property
    def schedule(self):
        return "zero_bubble" if self.zero_bubble else "interleaved" if self.v > 1 else "1f1b"

    def with_(self, **changes):
        return replace(self, **changes)


def local_numel(w, tp, ep, kv_heads=None, etp=None):
    """Elements of weight ``w`` on one rank: tensor parallelism by its split (chapter 4: KV heads
    split when tp divides them, one per rank when tp is a multiple of them), experts 1/ep each, split
    by ``etp`` (default tp; 1 when experts are folded, `ParallelDims.fold_ep`)."""
    if w.expert and etp is not None:
        tp = etp
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
    return dict(zip(("dense", "expert"), stage_params(model, d.tp, d.pp, d.ep, plan.v, stage, d.etp)))


@functools.lru_cache(maxsize=None)
def stage_params(model, tp, pp, ep, v, stage, etp=None):
    """(dense, expert) elements of `stage_weights`, added up by layer kind (the same sum, faster); ``etp``:
    the experts' tensor-parallel degree (`local_numel`)."""
    n, n_moe = stage_layer_counts(model, pp, v, stage)
    extra = (model.embedding_weights() if stage == 0 else []) + (model.head_weights() if stage == pp - 1
                                                                 else [])
    if model.tied and pp > 1 and stage == pp - 1:
        extra += model.embedding_weights()[:1]
    dense = sum(local_numel(w, tp, ep, model.kv_heads) for w in extra)
    expert = 0
    for moe, count in ((False, n - n_moe), (True, n_moe)):
        if count:
            d, e = _layer_params(model, moe, tp, ep, etp)
            dense, expert = dense + count * d, expert + count * e
    return dense, expert


@functools.lru_cache(maxsize=None)
def _layer_params(model, moe, tp, ep, etp=None):
    ws = model.layer_weights(next(i for i in range(model.layers) if model.is_moe_layer(i) == moe))
    return (sum(local_numel(w, tp, ep, model.kv_heads) for w in ws if not w.expert),
            sum(local_numel(w, tp, ep, model.kv_heads, etp) for w in ws if w.expert))


@functools.lru_cache(maxsize=None)
def state_bytes(zero, n, recipe, offload=False):
    """Bytes per parameter on a rank of a data-parallel group of n: chapter 1's ZeRO stages 0-2,
    chapter 3's FSDP2 pieces for stage 3, as weights / gradients / optimizer; offloaded, the GPU
    keeps the 16-bit weights (sharded at stage 3) and gradient partition (ZeRO-Offload's)."""
    if offload:   # gradients go to the host as they are reduced (Ren et al. 2021, §4.1)
        return {"weights": BF16 / (n if zero == 3 else 1), "gradients": 0.0, "optimizer": 0.0}
    if zero == 3:
        pieces = FSDP2_PIECES
        return {"weights": pieces["params"] / n, "gradients": pieces["grads"] / n,
                "optimizer": pieces["adam_moments"] / n}
    b = state_bytes_per_param(zero, n, recipe)
    return {"weights": b["parameters"], "gradients": b["gradients"], "optimizer": b["optimizer_state"]}


def expert_group(group, tp, ep, etp):
    """Ranks holding the same experts, from the ``group`` of ranks holding the same dense weights (dp cp):
    dp cp / ep, or tp dp cp / ep when the experts are folded (``etp`` = 1; `ParallelDims.fold_ep`)."""
    return max(group * tp // (ep * etp), 1)


@functools.lru_cache(maxsize=None)
def state_terms(model, tp, pp, ep, v, stage, zero, group, recipe, offload=False, etp=None):
    """Weights, gradients, optimizer state: the rank's parameters times chapter 1's (or, stage 3,
    chapter 3's FSDP2) bytes per parameter over the data-parallel group (dp cp; for experts the ranks
    holding the same experts, dp cp / ep, or tp dp cp / ep when they are folded: ``etp`` = 1)."""
    etp = tp if etp is None else etp
    dense_n, expert_n = stage_params(model, tp, pp, ep, v, stage, etp)
    dense = state_bytes(zero, group, recipe, offload)
    expert = state_bytes(zero, expert_group(group, tp, ep, etp), recipe, offload)
    return tuple(dense_n * dense[t] + expert_n * expert[t] for t in ("weights", "gradients", "optimizer"))


@functools.lru_cache(maxsize=None)
def layer_bytes(model, kernels, moe_layer, b, tp, cp, recompute, sp):
    """One layer's activations for one micro-batch of b sequences on one rank (chapter 1's formulas)
    under ``kernels``: "materialized" (scores written out), "flash" (FlashAttention, the SwiGLU op by
    op: the book's Llama block) or "fused" (FlashAttention and a fused SwiGLU, `fused_swiglu`)."""
    s, attention = model.seq // cp, "materialized" if kernels == "materialized" else "flash"
    if model.mlp == "gelu" and model.kv_heads == model.heads:     # the GPT-3 block, Korthikanti et al. 2022
        if recompute == "selective_ops":
            recompute = "selective"
        return activations.gpt3_activation_bytes_per_layer(s, b, model.hidden, model.heads, tp, sp, recompute,
                                                           attention=attention)
    # an MoE layer: the activations of the k routed and the shared experts a token visits
    ffn = (model.top_k + model.shared_experts) * model.expert_ffn if moe_layer else model.ffn
    terms = activations.llama_fused_mlp_terms if kernels == "fused" and model.mlp == "swiglu" else \
        activations.llama_activation_terms
    kw = {} if terms is activations.llama_fused_mlp_terms else {"mlp": model.mlp}
    return sum(terms(s, b, model.hidden, model.heads, model.kv_heads, ffn, tp, sp, recompute, attention,
                     head_dim=model.head_dim, **kw).values())


@functools.lru_cache(maxsize=None)
def stage_layer_counts(model, pp, v, stage):
    """(layers, of which MoE) on rank ``stage``."""
    layers = stage_layers(model.layers, pp, v)[stage]
    return len(layers), sum(model.is_moe_layer(i) for i in layers)


def activations_bytes(model, c, kernels):
    """Activations candidate c's rank holds at its peak (`grid.Candidate`): `stage_activations`."""
    return stage_activations(model, kernels, c.pp, c.v, c.stage, c.sched, c.m, c.b, c.tp, c.cp, c.rc, c.sp,
                             c.ckpt)


def stage_activations(model, kernels, pp, v, stage, sched, m, b, tp, cp, rc, sp, ckpt):
    """Chapter 5's peak chunk micro-batches times the layers of an average chunk, plus one layer rebuilt by
    recomputation (``rc``, ``sched``: indices of `software.RECOMPUTE`, `SCHEDULES`). Pieces are floats
    combined in a fixed order: the bytes are the same to the last bit however the planner gathers them."""
    n, n_moe = stage_layer_counts(model, pp, v, stage)
    if not n:
        return 0.0
    chunks = float(schedules.peak_chunks("interleaved" if sched == 1 else "1f1b", pp, m, v, stage))
    recompute, full, sp = RECOMPUTE[rc], RECOMPUTE[rc] == "full", bool(sp)
    # a kind of layer the stage does not hold adds nothing (0 x its bytes): not looked up
    dense, moe = (float(layer_bytes(model, kernels, k, b, tp, cp, recompute, sp)) if count else 0.0
                  for k, count in ((False, n - n_moe), (True, n_moe)))
    rebuilt = float(layer_bytes(model, kernels, n_moe > 0, b, tp, cp, "none", sp)) * (ckpt if full else 1) \
        if full or recompute == "selective_ops" else 0.0
    kept = -(-n // ckpt) / max(n, 1) if full else 1.0    # one input per k layers
    return chunks * kept * ((n - n_moe) * dense + n_moe * moe) / v + rebuilt


@functools.lru_cache(maxsize=None)
def logits_bytes(model, tp, cp, b, eager_loss=False):
    """The tail's peak on the last stage (chapter 1), vocabulary-parallel over tp (chapter 4): its forward
    peak, or with PyTorch's cross-entropy on an fp32 copy of the logits (``eager_loss``) its higher
    backward peak (`activations.tail_backward_peak_bytes`)."""
    s, V = model.seq // cp, -(-model.vocab // tp)
    forward = activations.tail_forward_peak_bytes(s, b, V, BF16, target_copy=False)
    return max(forward, activations.tail_backward_peak_bytes(s, b, V)) if eager_loss else forward


@functools.lru_cache(maxsize=None)
def fsdp_buffer_bytes(model, zero, tp, pp, ep, v, stage, reshard, unit="layer", grad_bytes=BF16, etp=None):
    """FSDP2's gathered bf16 unit and the next one (prefetch) with the unit's unsharded bf16 and fp32
    gradient (chapter 3); kept gathered after forward, the stage's bf16 weights and its gradients, which
    under a pipeline accumulate unsharded over the micro-batches in the reduction's dtype (``grad_bytes``):
    torch.distributed.pipelining turns FSDP's gradient sync off until the last backward (stage.py,
    ``backward_maybe_with_nosync``) and FSDP2 then upcasts each unsharded gradient to its reduce dtype
    (_fully_shard/_fsdp_param.py, ``to_accumulated_grad_if_needed``; torch 2.13). A unit is a layer
    (FSDP wraps each block) or, for DeepSpeed's per-module hooks, the largest weight."""
    if zero != 3:
        return 0
    if not reshard:
        return (BF16 + (grad_bytes if pp > 1 else BF16)) * sum(stage_params(model, tp, pp, ep, v, stage, etp))
    pick = sum if unit == "layer" else max
    size = max((pick(local_numel(w, tp, ep, model.kv_heads, etp) for w in model.layer_weights(i))
                for i in _kinds(model, pp, v, stage)), default=0)
    return 2 * BF16 * size + (BF16 + 4) * size


def buffers_bytes(model, c, unit="layer", grad_bytes=BF16):
    """What is gathered for one layer at a time on candidate c's rank: `stage_buffers` of its FSDP units."""
    fsdp = fsdp_buffer_bytes(model, c.zero, c.tp, c.pp, c.ep, c.v, c.stage, c.reshard, unit, grad_bytes,
                             c.etp)
    return stage_buffers(model, fsdp, c.tp, c.sp, c.b, c.cp)


def stage_buffers(model, fsdp, tp, sp, b, cp):
    """FSDP2's units (``fsdp``: `fsdp_buffer_bytes`), sequence parallelism's all-gathered layer input
    (chapter 6), all-gather CP's K and V of the whole sequence (chapter 6)."""
    gathered = BF16 * b * (model.seq // cp) * model.hidden if tp > 1 and sp == 1 else 0
    kv = max(model.kv_heads // tp, 1) * model.head_dim
    return float(fsdp) + gathered + (2 * BF16 * b * model.seq * kv if cp > 1 else 0)


@functools.lru_cache(maxsize=None)
def _kinds(model, pp, v, stage):
    """One layer of each kind (dense, MoE) on this rank: the formulas differ only by kind."""
    return tuple({model.is_moe_layer(i): i for i in stage_layers(model.layers, pp, v)[stage]}.values())


def terms(model, c, recipe, kernels, unit="layer", grad_bytes=BF16, eager_loss=False):
    """The six TERMS of candidate c (`grid.Candidate`), in bytes; ``unit``: what ZeRO-3 gathers at a time,
    ``grad_bytes``: a gradient element in its reduction (`fsdp_buffer_bytes`), ``eager_loss``: PyTorch's
    cross-entropy on fp32 logits (`logits_bytes`)."""
    state = state_terms(model, c.tp, c.pp, c.ep, c.v, c.stage, c.zero, zero_group(c.zero, c.dp, c.dpr, c.cp),
                        recipe, bool(c.offload), c.etp)
    tail = float(logits_bytes(model, c.tp, c.cp, c.b, eager_loss)) if c.stage == c.pp - 1 else 0.0
    return tuple(float(t) for t in state) + (activations_bytes(model, c, kernels), tail,
                                             buffers_bytes(model, c, unit, grad_bytes))


def zero_group(zero, dp, dpr, cp):
    """The ranks ZeRO shards a dense weight's state over: dp cp, HSDP's shard group under ZeRO-3."""
    return (dp // dpr if zero == 3 else dp) * cp


def total(values):
    """``values`` added left to right (TERMS order), as the planner always added them; not sum(), which
    Python 3.12 compensates: the same total on every Python."""
    out = 0.0
    for v in values:
        out += v
    return out


def rank_memory_terms(model, plan, recipe, kernels, m, stage):
    """The six TERMS of rank ``stage`` of one layout, as floats."""
    return terms(model, Candidate.one(plan, m, stage), recipe, kernels)


def rank_memory(model, plan, recipe, kernels, m, stage):
    """{term: bytes} of rank ``stage``, the six TERMS."""
    return dict(zip(TERMS, rank_memory_terms(model, plan, recipe, kernels, m, stage)))


def overflow(mem, capacity):
    """The first term, in TERMS order, at which the running total passes ``capacity``; None if it
    fits. ``mem``: {term: bytes} or a tuple in TERMS order."""
    total = 0
    for term, value in zip(TERMS, mem.values() if isinstance(mem, dict) else mem):
        total += value
        if total > capacity:
            return term
    return None
