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
from labs.memory_budget.budget import MODELS, PEAK_FLOPS

# H100 SXM, dense BF16 tensor-core peak (NVIDIA H100 datasheet: 1,979 with sparsity): chapter 1's one figure
H100_BF16_DENSE = PEAK_FLOPS["H100 SXM, bf16 dense"]


# --- parameters: derived beside counted --------------------------------------------------------

def llama_block_params(h, a, kv_heads, ffn):
    """One Llama block's parameters by weight (Touvron et al. 2023, §2.2; GQA: Ainslie et al. 2023).

    wq, wo: h x h; wk, wv: h x (kv_heads * d) with d = h / a (GQA shrinks only these two);
    w1, w2, w3: h x ffn (SwiGLU); two RMSNorm weights of h. "matmul" is what a token is multiplied by.
    """
    if h % a or a % kv_heads:
        raise ValueError(f"h={h}, a={a}, kv_heads={kv_heads}: a must divide h and kv_heads must divide a.")
    kv = kv_heads * (h // a)
    out = {"wq": h * h, "wk": h * kv, "wv": h * kv, "wo": h * h, "w1": h * ffn, "w2": ffn * h, "w3": h * ffn,
           "norms": 2 * h}
    out["matmul"] = out["total"] = sum(out.values())
    out["matmul"] -= out["norms"]
    return out


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


def arch_matmul_params(arch):
    """A `labs.memory_budget.budget.MODELS` entry's matmul weights: L blocks and the untied LM head
    (not the embedding)."""
    block = llama_block_params(arch.hidden, arch.heads, arch.kv_heads, arch.ffn)["matmul"]
    return arch.layers * block + arch.hidden * arch.vocab


# --- FLOPs per token: the formula ---------------------------------------------------------------

def flops_per_token(matmul_params, layers, hidden, seq, causal=False):
    """Model FLOPs per token (PaLM, Appendix B): forward 2P + 4Lhs, backward 4P + 8Lhs, total 6P + 12Lhs.

    causal=True halves the attention term: what a kernel that skips the masked half needs.
    """
    if min(matmul_params, layers, hidden, seq) <= 0:
        raise ValueError("matmul_params, layers, hidden and seq must all be positive.")
    attention = 4 * layers * hidden * seq / (2 if causal else 1)   # forward: q k^T and scores @ v
    fwd = 2 * matmul_params + attention
    return {"forward": fwd, "backward": 2 * fwd, "total": 3 * fwd, "attention": 3 * attention,
            "matmul": 6 * matmul_params}


def recompute_flops_per_token(block_matmul_params, layers, hidden, seq, recompute="full"):
    """FLOPs recomputation adds per token in backward: "full" reruns each block's forward
    (2P_block + 4hs per layer; the LM head is not recomputed), "selective" only the attention core's
    q k^T and scores @ v, 4hs per layer (Korthikanti et al. 2022, arXiv 2205.05198, §4.2)."""
    per_layer = {"none": 0, "selective": 4 * hidden * seq, "full": 2 * block_matmul_params + 4 * hidden * seq}
    if recompute not in per_layer:
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}.")
    return layers * per_layer[recompute]


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

def mfu(tokens_per_s, flops_per_token, n_gpus, peak=H100_BF16_DENSE):
    """Model FLOPs utilization (PaLM, §4.1): model FLOPs per token x tokens/s over n_gpus x peak."""
    if min(tokens_per_s, flops_per_token, n_gpus, peak) <= 0:
        raise ValueError("tokens_per_s, flops_per_token, n_gpus and peak must all be positive.")
    return tokens_per_s * flops_per_token / (n_gpus * peak)


def hfu(tokens_per_s, flops_per_token, recompute_per_token, n_gpus, peak=H100_BF16_DENSE):
    """Hardware FLOPs utilization: as `mfu`, counting the recomputed FLOPs too; HFU >= MFU."""
    if recompute_per_token < 0:
        raise ValueError(f"recompute_per_token must be >= 0, got {recompute_per_token}.")
    return mfu(tokens_per_s, flops_per_token + recompute_per_token, n_gpus, peak)


# Llama 3 405B pre-training, Table 4 of Llama Team 2024 (arXiv 2407.21783, §3.3.2), as printed.
LLAMA3_405B_TABLE4 = (
    {"gpus": 8192, "tp": 8, "cp": 1, "pp": 16, "dp": 64, "seq": 8192, "batch_per_dp": 32, "tflops": 430,
     "mfu_pct": 43},
    {"gpus": 16384, "tp": 8, "cp": 1, "pp": 16, "dp": 128, "seq": 8192, "batch_per_dp": 16, "tflops": 400,
     "mfu_pct": 41},
    {"gpus": 16384, "tp": 8, "cp": 16, "pp": 16, "dp": 4, "seq": 131072, "batch_per_dp": 16, "tflops": 380,
     "mfu_pct": 38},
)
LLAMA3_TOKENS_PER_BATCH = 16 * 2 ** 20   # "16M"
LLAMA3_TOKENS, LLAMA3_FLOPS = 15.6e12, 3.8e25   # §3.1 and §1: 15.6T tokens, 3.8 x 10^25 FLOPs


def llama3_405b(peak=H100_BF16_DENSE):
    """Table 4 recomputed: each row's MFU = TFLOP/s per GPU / peak, checked against the printed
    percentage (the TFLOP/s column is printed to tens, so [t - 5, t + 5] / peak must reach the
    percentage's +-0.5 band); the implied tokens/s from the model FLOPs per token at the row's
    sequence length; the parallel degrees multiplied out; and 6 Psi D against the paper's budget."""
    arch = MODELS["405B"]
    p_mm = arch_matmul_params(arch)
    rows = []
    for r in LLAMA3_405B_TABLE4:
        per_token = flops_per_token(p_mm, arch.layers, arch.hidden, r["seq"])["total"]
        lo, hi = 100 * (r["tflops"] - 5) * 1e12 / peak, 100 * (r["tflops"] + 5) * 1e12 / peak
        tokens_per_s = r["gpus"] * r["tflops"] * 1e12 / per_token
        rows.append({**r, "mfu_computed": r["tflops"] * 1e12 / peak,
                     "mfu_consistent": lo <= r["mfu_pct"] + 0.5 and hi >= r["mfu_pct"] - 0.5,
                     "flops_per_token": per_token,
                     "attention_share": 12 * arch.layers * arch.hidden * r["seq"] / per_token,
                     "tokens_per_s": tokens_per_s, "step_s": LLAMA3_TOKENS_PER_BATCH / tokens_per_s,
                     "degrees_product": r["tp"] * r["cp"] * r["pp"] * r["dp"],
                     "tokens_per_batch": r["dp"] * r["batch_per_dp"] * r["seq"]})
    psi = arch.params()
    return {"params": psi, "matmul_params": p_mm, "rows": rows,
            "six_psi_d": 6 * psi * LLAMA3_TOKENS, "paper_flops": LLAMA3_FLOPS,
            "with_attention_8k": flops_per_token(p_mm, arch.layers, arch.hidden, 8192)["total"]
            * LLAMA3_TOKENS}
