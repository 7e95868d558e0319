"""Chapter 1, compute as formulas: parameters by weight, FLOPs per token, MFU and HFU, Llama 3's Table 4.

The model (Kaplan et al. 2020, arXiv 2001.08361, §2.1; Chowdhery et al. 2022, PaLM, arXiv
2204.02311, Appendix B). A matmul of a token's activations with a weight of P elements costs 2P
FLOPs forward (one multiply, one add); backward computes two matmuls of the same size, the gradient
of the input and of the weight: 4P. With P_mm the matmul weights a token meets and full s x s
attention (q k^T and scores @ v, 2 s h FLOPs each per token and layer):

    forward  2 P_mm + 4 L h s      backward  4 P_mm + 8 L h s      total  6 P_mm + 12 L h s

Recomputation adds a forward of what is recomputed: it counts in HFU, not in MFU (PaLM §4.1 and
Appendix B). Chapter 1's lab counts these FLOPs with torch's FlopCounterMode
(`labs.memory_budget.compute`).
"""
import math
from fractions import Fraction

from labs.formulas.memory import MODELS, PEAK_FLOPS

# H100 SXM, dense BF16 tensor-core peak (NVIDIA H100 datasheet: 1,979 with sparsity): chapter 1's one figure
H100_BF16_DENSE = PEAK_FLOPS["H100 SXM, bf16 dense"]


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


def arch_matmul_params(arch):
    """A `labs.memory_budget.budget.MODELS` entry's matmul weights: L blocks and the untied LM head
    (not the embedding)."""
    block = llama_block_params(arch.hidden, arch.heads, arch.kv_heads, arch.ffn)["matmul"]
    return arch.layers * block + arch.hidden * arch.vocab


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


# Llama 3 405B pre-training, Table 4 of Llama Team 2024 (arXiv 2407.21783, §3.3.2), as printed before
# arXiv v3: the 131,072-token row gives DP 4, whose degrees multiply to 8,192 GPUs and 8M tokens.
# Chapters 2, 5 and 14 check that print; `LLAMA3_405B_TABLE4_V3` is the table to cite.
LLAMA3_405B_TABLE4 = (
    {"gpus": 8192, "tp": 8, "cp": 1, "pp": 16, "dp": 64, "seq": 8192, "batch_per_dp": 32, "tflops": 430,
     "mfu_pct": 43},
    {"gpus": 16384, "tp": 8, "cp": 1, "pp": 16, "dp": 128, "seq": 8192, "batch_per_dp": 16, "tflops": 400,
     "mfu_pct": 41},
    {"gpus": 16384, "tp": 8, "cp": 16, "pp": 16, "dp": 4, "seq": 131072, "batch_per_dp": 16, "tflops": 380,
     "mfu_pct": 38},
)


# Table 4 as arXiv v3 (23 November 2024) prints it: DP 8 in the 131,072-token row, so that TP x CP x
# PP x DP = 16,384 GPUs and DP x 16 x 131,072 = 16M tokens (an author confirmed the typo in
# github.com/meta-llama/llama3 issue #324, 30 August 2024; book/appendix-disputes.md, entry 19).
LLAMA3_405B_TABLE4_V3 = LLAMA3_405B_TABLE4[:2] + ({**LLAMA3_405B_TABLE4[2], "dp": 8},)


LLAMA3_TOKENS_PER_BATCH = 16 * 2 ** 20   # "16M"


LLAMA3_TOKENS, LLAMA3_FLOPS = 15.6e12, 3.8e25   # §3.1 and §1: 15.6T tokens, 3.8 x 10^25 FLOPs


def _band(printed, half):
    """The half-open interval [printed - half, printed + half) a value printed as ``printed`` came
    from, rounding half up (the rule the book finds in the ZeRO paper's 7.5B column), as Fractions."""
    return Fraction(printed) - Fraction(half), Fraction(printed) + Fraction(half)


def table4_peak_band(row):
    """The open interval of peaks (FLOP/s) at which some TFLOP/s that prints as ``row["tflops"]``
    (to tens: [t - 5, t + 5)) gives some MFU that prints as ``row["mfu_pct"]`` (to units):
    peak = TFLOP/s / MFU, so (t_lo / m_hi, t_hi / m_lo), exact in Fractions."""
    t_lo, t_hi = _band(row["tflops"] * 10 ** 12, 5 * 10 ** 12)
    m_lo, m_hi = _band(Fraction(row["mfu_pct"], 100), Fraction(1, 200))
    return t_lo / m_hi, t_hi / m_lo


def table4_peak_bounds(table=None):
    """The peaks (FLOP/s, an open interval) every row of Table 4 allows at once: the table alone
    says the peak lies between these; the datasheet's 989 TFLOP/s must lie inside."""
    bands = [table4_peak_band(r) for r in (table or LLAMA3_405B_TABLE4_V3)]
    return max(lo for lo, _ in bands), min(hi for _, hi in bands)


def llama3_405b(peak=H100_BF16_DENSE, table=LLAMA3_405B_TABLE4_V3):
    """Table 4 (arXiv v3 by default) recomputed against ``peak``.

    Each row's MFU = TFLOP/s per GPU / peak. "mfu_consistent": ``peak`` lies strictly inside the
    row's `table4_peak_band` (some TFLOP/s printing as the row's, over ``peak``, prints as its MFU);
    a peak of 1,000 TFLOP/s fails the 16,384-GPU 8K row, the sparse 1,979 every row.
    "mfu_rounds_to_print": the printed TFLOP/s over ``peak``, rounded half up, is the printed MFU;
    at 989 it holds for the first and third rows, not the second (400 / 989 = 40.4 %, printed 41).
    Then the tokens/s the TFLOP/s imply at the row's sequence length under the book's count (all
    s x s scores) and with the attention term halved for a causal mask ("_causal"); the parallel
    degrees multiplied out; and 6 Psi D against the paper's budget."""
    arch = MODELS["405B"]
    p_mm = arch_matmul_params(arch)
    rows = []
    for r in table:
        per_token = flops_per_token(p_mm, arch.layers, arch.hidden, r["seq"])["total"]
        causal = flops_per_token(p_mm, arch.layers, arch.hidden, r["seq"], causal=True)["total"]
        lo, hi = table4_peak_band(r)
        computed = Fraction(r["tflops"] * 10 ** 12) / Fraction(peak)
        tokens_per_s = r["gpus"] * r["tflops"] * 1e12 / per_token
        tokens_causal = r["gpus"] * r["tflops"] * 1e12 / causal
        rows.append({**r, "mfu_computed": r["tflops"] * 1e12 / peak,
                     "mfu_consistent": lo < Fraction(peak) < hi,
                     "mfu_rounds_to_print": math.floor(100 * computed + Fraction(1, 2)) == r["mfu_pct"],
                     "flops_per_token": per_token,
                     "attention_share": 12 * arch.layers * arch.hidden * r["seq"] / per_token,
                     "tokens_per_s": tokens_per_s, "step_s": LLAMA3_TOKENS_PER_BATCH / tokens_per_s,
                     "tokens_per_s_causal": tokens_causal,
                     "step_s_causal": LLAMA3_TOKENS_PER_BATCH / tokens_causal,
                     "degrees_product": r["tp"] * r["cp"] * r["pp"] * r["dp"],
                     "tokens_per_batch": r["dp"] * r["batch_per_dp"] * r["seq"]})
    psi = arch.params()
    return {"params": psi, "matmul_params": p_mm, "rows": rows,
            "six_psi_d": 6 * psi * LLAMA3_TOKENS, "paper_flops": LLAMA3_FLOPS,
            "with_attention_8k": flops_per_token(p_mm, arch.layers, arch.hidden, 8192)["total"]
            * LLAMA3_TOKENS}
