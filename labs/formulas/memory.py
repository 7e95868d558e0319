"""Chapter 1, the memory budget as formulas: bytes per parameter under each precision recipe and ZeRO
stage, activations of real models, and whether a configuration fits one GPU.

Units: GB = 1e9 bytes, as the papers print them (ZeRO's Table 1, model states); GiB = 2**30 bytes,
what a GPU holds (an "80 GB" H100 has 80 GiB of HBM, 85.9e9 bytes). Sizes are reported in both
where it matters; the capacity a configuration must fit in is ``gpu_gib``.

- model state: a recipe's bytes per parameter (`Recipe`; Micikevicius et al. 2018 as the ZeRO paper,
  Rajbhandari et al. 2019, §3.1, counts it: 2 + 2 + 12), sharded by ZeRO stage over dp (stage 1
  shards the optimizer state, stage 2 also the gradients, stage 3 also the weights) and split by tp
  and pp;
- activations of the Llama models: `labs.formulas.activations.llama_activation_terms`, with attention
  scores written out ("materialized") or through a fused kernel ("flash").
Chapter 1's lab (`labs.memory_budget.budget`) measures what this predicts on the tiny model.
"""
from dataclasses import dataclass

from labs.dims import ParallelDims
from labs.formulas.activations import (llama_activation_bytes_per_layer, llama_activation_terms,
                                       tail_forward_peak_bytes, tail_saved_bytes)
from labs.formulas.shape import ModelShape

ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


FP32 = 4  # bytes per fp32 element


@dataclass(frozen=True)
class Recipe:
    """Where each of a parameter's bytes lives."""
    weights: str           # the working weights' dtype, forward and backward: "bfloat16" or "float32"
    master: bool           # the optimizer keeps an fp32 master copy of the weights
    grad_buffer: bool      # gradients are accumulated into an fp32 buffer (Megatron's main_grad)
    keep_grads: bool       # the working-dtype .grad stays allocated beside that buffer
    about: str

    def bytes_per_param(self):
        w = ELEMENT_BYTES[self.weights]
        grads = (w if self.keep_grads else 0) + (FP32 if self.grad_buffer else 0)
        optimizer = (FP32 if self.master else 0) + 2 * FP32  # master + m + v
        return {"parameters": w, "gradients": grads, "optimizer_state": optimizer,
                "total": w + grads + optimizer}


RECIPES = {
    "mixed": Recipe("bfloat16", master=True, grad_buffer=False, keep_grads=True,
                    about="bf16 weights and grads; fp32 master, m, v (the ZeRO paper's 2+2+12)"),
    "mixed_fp32_grads": Recipe("bfloat16", master=True, grad_buffer=True, keep_grads=False,
                               about="bf16 weights; grads land in an fp32 buffer and the bf16 grad is freed"),
    "mixed_fp32_accum": Recipe("bfloat16", master=True, grad_buffer=True, keep_grads=True,
                               about="bf16 weights and grads, plus an fp32 buffer accumulating them"),
    "fp32": Recipe("float32", master=False, grad_buffer=False, keep_grads=True,
                   about="plain fp32: the weights are their own master copy"),
    "bf16_no_master": Recipe("bfloat16", master=False, grad_buffer=False, keep_grads=True,
                             about="bf16 weights updated in place, fp32 m and v (a 2 + 2 + 8 budget)"),
}


def recipe(name):
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}.")
    return RECIPES[name]


def recipe_bytes(name):
    """Bytes per parameter of recipe ``name``: parameters, gradients, optimizer_state, total."""
    return recipe(name).bytes_per_param()


GB = 1e9          # the papers' gigabyte


GIB = 2 ** 30     # what a GPU's memory is counted in


GPU_GIB = 80      # an H100 SXM "80GB": 80 GiB = 85.9e9 bytes


# Published shapes: Touvron et al. 2023 (Llama 2, Table 1: 4,096-token context) and Llama Team 2024
# (arXiv 2407.21783, Table 3; 405B pre-trained at 8,192 tokens, Table 4)
MODELS = {
    "7B": ModelShape("Llama 2 7B", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000,
                     seq=4096),
    "13B": ModelShape("Llama 2 13B", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000,
                      seq=4096),
    "70B": ModelShape("Llama 2 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000,
                      seq=4096),
    "405B": ModelShape("Llama 3 405B", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248,
                       vocab=128256, seq=8192),
}


def state_bytes_per_param(zero_stage=0, dp=1, recipe="mixed"):
    """Per-rank bytes per parameter of the model state under ZeRO over ``dp`` ranks."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0 (plain data parallel), 1, 2 or 3, got {zero_stage!r}.")
    b = recipe_bytes(recipe)
    out = {"parameters": b["parameters"] / (dp if zero_stage >= 3 else 1),
           "gradients": b["gradients"] / (dp if zero_stage >= 2 else 1),
           "optimizer_state": b["optimizer_state"] / (dp if zero_stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def model_activations(model="7B", seq=4096, micro_batch=1, tp=1, sp=False, recompute="none",
                      attention="materialized"):
    """One MODELS entry's activations: per layer (with its terms) and for all L layers, in bytes.

    L layers' worth is also what 1F1B's first stage holds whatever pp is: p micro-batches of L/p layers.
    """
    arch = _arch(model)
    terms = llama_activation_terms(seq, micro_batch, arch.hidden, arch.heads, arch.kv_heads, arch.ffn, tp, sp,
                                   recompute, attention)
    per_layer = sum(terms.values())
    return {"model": model, "seq": seq, "micro_batch": micro_batch, "tp": tp, "sequence_parallel": sp,
            "recompute": recompute, "attention": attention, "terms": terms, "per_layer_bytes": per_layer,
            "layers": arch.layers, "total_bytes": arch.layers * per_layer}


def _arch(model):
    """A `MODELS` key's shape, or the `ModelShape` given."""
    if isinstance(model, ModelShape):
        return model
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}.")
    return MODELS[model]


def budget(model="7B", world_size=8, tp=1, pp=1, zero_stage=0, recipe="mixed", seq=4096,
           micro_batch=1, recompute="none", sp=False, attention="materialized", gpu_gib=GPU_GIB):
    """Bytes per device for one configuration, and whether they fit in ``gpu_gib`` GiB.

    Result: ``bytes_per_device``, ``gb_per_device`` (1e9) and ``gib_per_device`` (2**30), each with
    parameters, gradients, optimizer_state, activations (Llama formula) and total; ``capacity_bytes``
    = gpu_gib * 2**30; ``fits``: total bytes <= capacity_bytes.
    """
    arch = _arch(model)
    dp = ParallelDims.build(world_size, tp=tp, pp=pp).dp       # the degrees, checked once
    if arch.layers % pp or arch.heads % tp or arch.ffn % tp or (arch.kv_heads % tp and tp % arch.kv_heads):
        raise ValueError(f"{arch.name} has {arch.layers} layers, {arch.heads} heads, {arch.kv_heads} "
                         f"KV heads and MLP width {arch.ffn}: pp must divide the layers and tp the heads "
                         "and the width (and divide or be a multiple of the KV heads) (got "
                         f"pp={pp}, tp={tp}).")
    psi = arch.params()
    per_param = state_bytes_per_param(zero_stage, dp, recipe)
    dev = {k: v * psi / (tp * pp) for k, v in per_param.items() if k != "total"}
    acts = model_activations(model, seq, micro_batch, tp, sp, recompute, attention)
    dev["activations"] = acts["total_bytes"]
    dev["total"] = sum(dev.values())
    capacity = gpu_gib * GIB
    return {"model": model, "params": psi, "world_size": world_size, "dp": dp, "tp": tp, "pp": pp,
            "zero_stage": zero_stage, "recipe": recipe, "seq": seq, "micro_batch": micro_batch,
            "recompute": recompute, "sequence_parallel": sp, "attention": attention, "gpu_gib": gpu_gib,
            "capacity_bytes": capacity, "bytes_per_device": dev,
            "gb_per_device": {k: v / GB for k, v in dev.items()},
            "gib_per_device": {k: v / GIB for k, v in dev.items()}, "fits": dev["total"] <= capacity}


def flash_at_scale(models=("7B", "70B"), seq=4096, micro_batch=1):
    """What FlashAttention does to the Llama activation figures (`model_activations`, no
    recomputation): all layers with the scores written out and fused, the bytes removed, and the part
    of them that is the softmax output alone, L * 2as^2b (the rest: k and v copies to a heads, less
    the log-sum-exp)."""
    out = {}
    for name in models:
        m, f = (model_activations(name, seq, micro_batch, attention=k)["total_bytes"]
                for k in ("materialized", "flash"))
        arch = MODELS[name]
        out[name] = {"materialized_bytes": m, "flash_bytes": f, "removed_bytes": m - f,
                     "removed_fraction": (m - f) / m,
                     "scores_bytes": arch.layers * 2 * arch.heads * seq * seq * micro_batch}
    return out


def fit_grid(model="7B", world_size=8, zero_stage=1, seq=4096, micro_batch=1, tp=1, pp=1, sp=False,
             gpu_gib=GPU_GIB):
    """Does it fit, under each recomputation and attention kind? E.g. ZeRO-1 on 8 GPUs, 7B, s=4096, b=1.

    One row per (recompute, attention): state, activations and total in GiB, the headroom left in
    ``gpu_gib`` (negative: short by that much) and ``fits``. Temporary buffers, the logits and
    fragmentation are not counted (Rajbhandari et al. 2019, §3.2), so a thin margin is no margin.
    """
    rows = []
    for recompute in ("none", "selective", "full"):
        for attention in ("materialized", "flash"):
            r = budget(model, world_size, tp, pp, zero_stage, "mixed", seq, micro_batch, recompute, sp,
                       attention, gpu_gib)
            g = r["gib_per_device"]
            rows.append({"recompute": recompute, "attention": attention, "activations_gib": g["activations"],
                         "state_gib": g["total"] - g["activations"], "total_gib": g["total"],
                         "headroom_gib": gpu_gib - g["total"], "fits": r["fits"]})
    return rows


def lowest_zero_stage(model, world_size, headroom=0.1, gpu_gib=GPU_GIB, **settings):
    """The lowest ZeRO stage at which ``budget(model, world_size, ...)`` leaves at least ``headroom``
    of the GPU free (for the temporary buffers, logits and fragmentation the budget does not count),
    or None when no stage does."""
    for stage in (0, 1, 2, 3):
        r = budget(model, world_size, zero_stage=stage, gpu_gib=gpu_gib, **settings)
        if r["bytes_per_device"]["total"] <= (1 - headroom) * r["capacity_bytes"]:
            return stage
    return None


def fewest_gpus(model, zero_stage, activations=True, limit=1024, gpu_gib=GPU_GIB, **settings):
    """The fewest data-parallel GPUs on which ``model``'s state under ``zero_stage`` (with
    ``activations``, also one micro-batch's, from ``settings``) fits ``gpu_gib``; None up to ``limit``."""
    for n in range(1, limit + 1):
        r = budget(model, n, zero_stage=zero_stage, gpu_gib=gpu_gib, **settings)["bytes_per_device"]
        if r["total"] - (0 if activations else r["activations"]) <= gpu_gib * GIB:
            return n
    return None


# Link speeds, one direction, from vendors' specifications (bytes/s; NVMe: a fast drive's read rate).
LINKS = {"PCIe 4.0 x16": 32e9, "PCIe 5.0 x16": 64e9, "NVMe drive (PCIe 4.0 x4)": 7e9,
         "NVLink 4 (H100)": 450e9, "InfiniBand NDR (400 Gb/s)": 50e9,
         # a ring across H100 nodes that uses all 8 NDR NICs of each node at once (one per GPU, one
         # NCCL channel per rail): the node's egress, 8 x 50 GB/s, the figure Austin et al. 2025,
         # Part 12 ("Rooflines for LLM Scaling on GPUs") use beyond a node (400e9)
         "InfiniBand NDR, 8 NICs per node": 8 * 50e9}


PEAK_FLOPS = {"H100 SXM, bf16 dense": 989e12}


def at_scale(model="405B", seq=8192, micro_batch=1, vocab=None, tp=1):
    """The tail at a real model's shapes (vocab overrides the model's, e.g. 128,256 for a Llama 2 7B
    with Llama 3's tokenizer), beside what one of its blocks keeps with FlashAttention (Llama formula).
    With a vocabulary-parallel head and loss the V terms divide by tp."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}.")
    arch = MODELS[model]
    V = vocab or arch.vocab
    if V % tp:
        raise ValueError(f"vocabulary {V} is not divisible by tp={tp}; pad it to a multiple of tp.")
    s, b, v_local = seq, micro_batch, V // tp
    layer = llama_activation_bytes_per_layer(s, b, arch.hidden, arch.heads, arch.kv_heads, arch.ffn, tp=tp,
                                             attention="flash")
    saved = tail_saved_bytes(s, b, arch.hidden, v_local)
    return {"model": model, "seq": s, "micro_batch": b, "vocab": V, "tp": tp,
            "logits_bf16_bytes": 2 * s * b * v_local, "log_softmax_fp32_bytes": 4 * s * b * v_local,
            "saved_bytes": saved,
            "forward_peak_bytes": tail_forward_peak_bytes(s, b, v_local, target_copy=False),
            "layer_flash_bytes": layer, "saved_in_layers": saved / layer}
