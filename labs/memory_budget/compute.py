"""Chapter 1, compute: FLOPs per token, derived and counted (`labs.measure.flops`: torch's FlopCounterMode),
and the utilization of a real run (MFU and HFU).

The model (Kaplan et al. 2020, arXiv 2001.08361, §2.1; Chowdhery et al. 2022, PaLM, arXiv
2204.02311, Appendix B). A matmul of a token's activations with a weight of P elements costs 2P
FLOPs forward (one multiply, one add); backward computes two matmuls of the same size, the gradient
of the input and of the weight: 4P. With P_mm the matmul weights a token meets (every linear layer
and the LM head; not the embedding lookup, the norms or the biases, which are no matmul) and full
s x s attention (q k^T and scores @ v, 2 s h FLOPs each per token and layer):

    forward  2 P_mm + 4 L h s      backward  4 P_mm + 8 L h s      total  6 P_mm + 12 L h s

per token; PaLM writes the attention term 6LH(2QT) = 12 L h s with H heads of size Q (HQ = h) and
sequence T. The code computes all s x s scores (the causal mask is added after ``q @ k^T``, and the
flop counter's formula for SDPA ignores causality too), so 12 L h s is what is counted; a causal
kernel that skips masked tiles needs about half. GQA does not lower it: every query head still
meets s keys. Recomputation adds a forward of what is recomputed: it counts in HFU (hardware FLOPs
utilization), not in MFU (model FLOPs utilization), PaLM §4.1 and Appendix B.
"""
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from labs import model as tiny
from labs.measure import flops
from labs.memory_budget.activations import recompute_attention_core
from labs.formulas.flops import (  # the formulas' home is the torch-free core
    H100_BF16_DENSE as H100_BF16_DENSE, LLAMA3_405B_TABLE4 as LLAMA3_405B_TABLE4,
    LLAMA3_405B_TABLE4_V3 as LLAMA3_405B_TABLE4_V3, LLAMA3_FLOPS as LLAMA3_FLOPS, LLAMA3_TOKENS as
    LLAMA3_TOKENS, LLAMA3_TOKENS_PER_BATCH as LLAMA3_TOKENS_PER_BATCH,
    arch_matmul_params as arch_matmul_params, flops_per_token as flops_per_token, hfu as hfu, llama3_405b
    as llama3_405b, llama_block_params as llama_block_params, mfu as mfu, recompute_flops_per_token as
    recompute_flops_per_token, table4_peak_bounds as table4_peak_bounds)


# --- parameters: derived beside counted --------------------------------------------------------


def counted_params(module):
    """Parameters counted from the module's tensors, by leaf name ({"wq": numel, ..., "norms": ...})."""
    out = {}
    for name, p in module.named_parameters():
        leaf = name.split(".")[-2]
        key = "norms" if leaf.endswith("norm") else leaf
        out[key] = out.get(key, 0) + p.numel()
    out["total"] = sum(out.values())
    return out


def gpt_matmul_params(cfg):
    """The tiny GPT's matmul weights: per layer qkv 3h^2, proj h^2, fc 4h^2, proj 4h^2; the head h V."""
    return cfg.n_layer * 12 * cfg.hidden ** 2 + cfg.hidden * cfg.vocab_size


# --- FLOPs per token: the formula ---------------------------------------------------------------


# --- FLOPs per token: the measurement (counted by labs.measure.flops) ------------------------

def checkpoint_blocks(net):
    """Full recomputation applied from outside: every block runs under a (non-reentrant) checkpoint."""
    for block in net.blocks:
        block.forward = lambda x, f=block.forward: checkpoint(f, x, use_reentrant=False)
    return net


def measure_gpt_flops(cfg=None, batch=2, seq=None, recompute="none", early_stop=False):
    """Forward and backward FLOPs of one training step of the tiny GPT, counted, beside the formula.

    recompute="full" checkpoints every block: backward then also counts the blocks' forward again.
    early_stop=True is PyTorch's default for the non-reentrant checkpoint: recomputation stops once
    every tensor backward needs is back, so each block's last matmul (the MLP's down-projection,
    whose output nothing saves) is not rerun: 2 x 4h^2 FLOPs per token and layer fewer than a full
    forward. Megatron's full recomputation reruns the whole layer (early_stop=False).
    """
    cfg = cfg or tiny.GPTConfig()
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute must be 'none' or 'full' for the GPT, got {recompute!r}.")
    net = tiny.build(cfg)
    if recompute == "full":
        checkpoint_blocks(net)
    x, y = tiny.synthetic_batch(cfg, batch, seed=0, seq_len=seq)
    tokens, s = x.numel(), x.size(1)                     # sizes from the batch actually run
    with set_checkpoint_early_stop(early_stop):
        out = flops.forward_backward(lambda: net(x, y))
    per_token = flops_per_token(gpt_matmul_params(cfg), cfg.n_layer, cfg.hidden, s)
    extra = recompute_flops_per_token(12 * cfg.hidden ** 2, cfg.n_layer, cfg.hidden, s, recompute)
    if recompute == "full" and early_stop:
        extra -= cfg.n_layer * 2 * 4 * cfg.hidden ** 2   # the down-projections not rerun
    out.update(tokens=tokens, seq=s, formula={"forward": tokens * per_token["forward"],
                                             "backward": tokens * (per_token["backward"] + extra)},
               model_flops=tokens * per_token["total"], recompute_flops=tokens * extra)
    return out


def measure_llama_flops(cfg=None, batch=2, seq=None, recompute="none", cpu_sdpa=True):
    """Forward and backward FLOPs of one `LlamaBlock` (input requiring grad), counted, beside the formula.

    cpu_sdpa=False shows what FlopCounterMode alone reports for SDPA on a CPU: no attention FLOPs.
    With SDPA, backward counts 5 attention matmuls, not 4: the kernel recomputes the scores, FLOPs
    that count in HFU, not MFU. recompute="selective" checkpoints the attention core.
    """
    cfg = cfg or tiny.LlamaConfig()
    s = seq or cfg.seq_len
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be 'none' or 'selective' for one block, got {recompute!r}.")
    torch.manual_seed(0)
    block = tiny.LlamaBlock(cfg)
    if recompute == "selective":
        recompute_attention_core(block)
    x = torch.randn(batch, s, cfg.hidden, requires_grad=True)
    out = flops.forward_backward(lambda: block(x).sum(), cpu_sdpa)
    tokens, h = x.shape[0] * x.shape[1], x.shape[2]
    p = llama_block_params(h, cfg.n_head, cfg.n_kv_head, cfg.ffn)["matmul"]
    per_token = flops_per_token(p, 1, h, s)
    # recomputed scores: inside the SDPA kernel's backward, or by the checkpoint (q k^T, and scores @ v)
    extra = 2 * h * s if cfg.attention == "sdpa" else 0
    extra += recompute_flops_per_token(p, 1, h, s, recompute)
    out.update(tokens=tokens, seq=s, params=counted_params(block), formula={
        "forward": tokens * per_token["forward"], "backward": tokens * (per_token["backward"] + extra)},
        model_flops=tokens * per_token["total"], recompute_flops=tokens * extra)
    return out


# --- utilization ------------------------------------------------------------------------------


