"""Chapter 14: a TFLOP/s per GPU that a report does not print, derived from its GPU hours, term by term.

DeepSeek-V3's report (DeepSeek-AI 2024, arXiv 2412.19437) prints no TFLOP/s or MFU. It prints the
cost: "training DeepSeek-V3 on each trillion tokens requires only 180K H800 GPU hours" (§1), so a
GPU processes 10^12 / (180,000 x 3,600) tokens per second, and a FLOP count per token turns that into
TFLOP/s. The count is PaLM's (Chowdhery et al. 2022, Appendix B; chapter 1), the one the planner
divides by (`labs.formulas.planning.timing.model_flops_per_token`): 6 FLOPs per matmul weight a token meets
(forward 2, backward 4) plus 12 L w s for the attention scores and their product with V, counted
without the causal half, w the attention width (for MLA the mean of the query-key and the value
widths). `breakdown` splits the same total by weight group, so a reader sees where it comes from:

    attention projections  MLA's down- and up-projections of q and kv and the output projection, every layer
    dense MLP              the first 3 layers' SwiGLU MLP
    router                 the gate of each MoE layer (256 x h)
    shared expert          one SwiGLU of width 2048 per MoE layer
    routed experts         8 of the 256 per token
    output head            h V
    attention              12 L w s (QK^T and scores @ V, forward and backward)

What it leaves out, and the figure it would give with each (`derived_tflops`):
- the multi-token prediction module (§2.2; depth D = 1, §4.2): one more MoE block, a projection of
  2h to h and the shared output head run again for every token, work the GPUs did;
- the causal half of attention, which a kernel that skips masked blocks does not compute;
- recomputation (§3.2.3 recomputes the RMSNorms and MLA's up-projections): hardware FLOPs, not model FLOPs.
So the 434 TFLOP/s the chapter quotes is a derived figure with a stated count, not a published one.
"""
from labs.formulas.planning import shapes, timing
from labs.planning import cases

GROUPS = {"attention projections": ("wq", "wkv", "wo"), "dense MLP": ("w1", "w2", "w3"),
          "router": ("router",), "shared expert": ("shared_",), "routed experts": ("experts_",)}


def _group(name):
    return next(g for g, prefixes in GROUPS.items() if name.startswith(prefixes))


def breakdown(model=shapes.DEEPSEEK_V3):
    """FLOPs per token by PaLM's count, by weight group (module docstring); the values sum to
    `timing.model_flops_per_token(model)` (integers, so exactly)."""
    out = dict.fromkeys(list(GROUPS) + ["output head", "attention"], 0)
    for i in range(model.layers):
        for w in model.layer_weights(i):
            if len(w.shape) == 2:         # vectors (norms) do no matmul
                active = w.numel // w.copies * model.top_k if w.expert else w.numel
                out[_group(w.name)] += 6 * active
    out["output head"] = 6 * model.hidden * model.vocab
    out["attention"] = 12 * model.layers * model.attention_width * model.seq
    return out


def mtp_flops_per_token(model=shapes.DEEPSEEK_V3, depth=1):
    """What ``depth`` multi-token prediction modules add per token by the same count (DeepSeek-V3
    §2.2): each runs one more MoE block, its projection M_k of 2h to h, and the shared output head."""
    block = model.block_matmul_params(model.layers - 1)   # an MoE layer's active matmul weights
    per_module = 6 * (block + 2 * model.hidden * model.hidden + model.hidden * model.vocab)
    return depth * (per_module + 12 * model.attention_width * model.seq)


def derived_tflops(model=shapes.DEEPSEEK_V3, gpu_hours_per_t_tokens=cases.DEEPSEEK_GPU_HOURS_PER_T_TOKENS):
    """TFLOP/s per GPU from the report's GPU hours: with the chapter's count (the breakdown's total,
    beside the planner's own count of the same model, which it must equal), with the MTP module
    added, and with causal attention (half the attention term)."""
    tokens_per_gpu_s = 1e12 / (gpu_hours_per_t_tokens * 3600)
    terms = breakdown(model)
    total = sum(terms.values())
    return {"terms": terms, "flops_per_token": total,
            "planner_flops_per_token": timing.model_flops_per_token(model),
            "tokens_per_gpu_s": tokens_per_gpu_s,
            "tflops": tokens_per_gpu_s * total / 1e12,
            "mtp_flops_per_token": mtp_flops_per_token(model),
            "tflops_with_mtp": tokens_per_gpu_s * (total + mtp_flops_per_token(model)) / 1e12,
            "tflops_causal": tokens_per_gpu_s * (total - terms["attention"] / 2) / 1e12}
