"""Chapter 14: how a published run's printed figure becomes TFLOP/s per GPU, and the models its rows name.

Each source divides by its own FLOP count: Narayanan et al.'s eq. 3, Korthikanti et al.'s eq. 7 and 8,
PaLM's count (Megatron-LM's current one, causal or not) and torchtitan's; each is written here as the
source writes it, so a row converts a printed tokens per second or MFU by its own source's formula
(`published_runs`). The peaks the papers divide by are here too.
"""
import dataclasses

from labs.memory_budget import compute
from labs.formulas.planning import shapes
from labs.planning import published_tables as t

# 312 TFLOP/s, the peak Narayanan, Korthikanti and MegaScale divide by
A100_PEAK = shapes.SELENE.peak_flops
H100_PEAK = compute.H100_BF16_DENSE        # 989 TFLOP/s, "989 teraFLOP/s" in Nemotron-4 15B §2


def degrees(gpus, tp=1, pp=1, cp=1, ep=1):
    """The degrees of a run on ``gpus`` (None: not stated, so dp is None too)."""
    return {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "dp": gpus // (tp * pp * cp) if gpus else None}


# --- FLOP counts per token, each the formula a source uses ----------------------------------------

def narayanan_eq3(m, seq):
    """Narayanan et al. 2021, eq. 3 per token: 96 l h^2 (1 + s/6h + V/16lh), recomputation counted."""
    L, h = m.layers, m.hidden
    return 96 * L * h * h * (1 + seq / (6 * h) + m.vocab / (16 * L * h))


def korthikanti_eq7(m, seq, hardware=False):
    """Korthikanti et al. 2022, eq. 7 per token, 72 L h^2 (1 + s/6h + V/12hL); eq. 8 (``hardware``) adds
    selective recomputation's attention: s/3h."""
    L, h = m.layers, m.hidden
    return 72 * L * h * h * (1 + seq / ((3 if hardware else 6) * h) + m.vocab / (12 * h * L))


def palm(m, seq, causal=False):
    """PaLM's count (Chowdhery et al. 2022, App. B; chapter 1): 6 P_mm + 12 L h s, the attention term halved
    with ``causal`` (Megatron-LM's current count, megatron/training/training.py: "causal mask"); the h of the
    attention term is the heads' width (Qwen3: 64 x 128)."""
    return compute.flops_per_token(m.matmul_params(), m.layers, m.attention_width, seq, causal)["total"]


def torchtitan_count(m, seq):
    """torchtitan at 9dec370, utils.get_num_flop_per_token: 6 x (parameters but the token embedding)
    + 12 L h s."""
    return 6 * (m.params() - m.vocab * m.hidden) + 12 * m.layers * m.hidden * seq


def tflops(tokens_per_gpu_s, flops_per_token):
    return tokens_per_gpu_s * flops_per_token / 1e12


def model(key, seq=None):
    """A `published_tables.MODEL_SHAPES` model, at ``seq`` tokens (default: its configuration's)."""
    m = t.MODEL_SHAPES[key]
    return dataclasses.replace(m, seq=seq) if seq else m


def gpt(name, layers, hidden, heads, vocab, seq=2048, tied=True):
    """A GPT of Megatron-LM: multi-head attention, a 4h GeLU MLP of two matrices, learned positions."""
    return shapes.gpt(name, layers, hidden, heads, vocab, seq, tied)
