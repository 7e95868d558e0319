"""Chapter 6: the activation table of Korthikanti et al. 2022 (arXiv 2205.05198, Table 2), measured
per rank on the tiny GPT block, every row: no parallelism, TP, TP+SP, TP or TP+SP with selective
recomputation, full recomputation.

Table 2, bytes per layer (s tokens, b sequences, h hidden, a heads, t the tensor-parallel size;
16-bit activations, 1-byte dropout masks): no parallelism sbh(34 + 5as/h); TP sbh(10 + 24/t +
5as/(ht)); TP+SP sbh(34/t + 5as/(ht)); TP with selective recomputation sbh(10 + 24/t); TP+SP with
selective recomputation sbh(34/t); full recomputation 2sbh. The per-op terms are chapter 1's
(`labs.memory_budget.activations`); the tiny block (`labs.model.Block`) keeps exactly them, plus the LayerNorm
statistics the table leaves out.
"""
import math

import torch
from torch.utils.checkpoint import checkpoint

from labs.memory_budget import activations
from labs.launcher import launch
from labs.measure import memory
from labs.context_parallel import sp_layers
from labs.tensor_parallel import blocks as tp, megatron


def _attention_core(attn, q, k, v):                           # (B, a/t, s, d) each -> (B, a/t, s, d)
    """The part of `labs.model.CausalSelfAttention` selective recomputation recomputes: q k^T,
    softmax, attention dropout and the product with v (the model writes it inline)."""
    T, d = q.size(2), q.size(-1)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    att = (att + attn.mask[:T, :T].to(att.dtype)).softmax(dim=-1)
    return attn.attn_drop(att) @ v


def recompute_attention_core(block):
    """Selective recomputation (Korthikanti et al. 2022, §5), applied from outside the model: the
    attention core runs under a reentrant checkpoint, which keeps q, k and v (6sbh/t bytes, through
    save_for_backward, where saved-tensor hooks see them) instead of the 5as^2b/t of scores, mask
    and dropout output; the RNG state is restored, so the recomputed dropout mask is the same."""
    attn = block.attn

    def forward(x):                                           # (B, s/t or s, H) -> (B, s, H) partial
        q, k, v = attn.qkv(x).chunk(3, dim=2)                 # 3 x (B, s, a*d/t)
        B, T, _ = q.shape
        d = q.size(-1) // attn.n_head
        q, k, v = (u.view(B, T, attn.n_head, d).transpose(1, 2) for u in (q, k, v))
        y = checkpoint(_attention_core, attn, q, k, v, use_reentrant=True)
        return attn.proj(y.transpose(1, 2).contiguous().view(B, T, -1))

    attn.forward = forward
    return block


ROWS = ("none", "tp", "tp_sp", "tp_selective", "tp_sp_selective", "tp_full", "tp_sp_full",
        "tp_sp_keep_gathered")


def table_formula(row, s, b, h, a, t):
    """Bytes per layer per rank: Table 2's rows, from `activations.gpt3_activation_bytes_per_layer`,
    plus two rows the table does not have: full recomputation under SP keeps the input shard,
    2sbh/t (the table's 2sbh is without SP), and SP keeping the gathered inputs of the two
    column-parallel layers instead of their shards, 2 x 2sbh(1 - 1/t) more than 34/t."""
    f = activations.gpt3_activation_bytes_per_layer
    return {"none": lambda: f(s, b, h, a), "tp": lambda: f(s, b, h, a, tp=t),
            "tp_sp": lambda: f(s, b, h, a, tp=t, sp=True),
            "tp_selective": lambda: f(s, b, h, a, tp=t, recompute="selective"),
            "tp_sp_selective": lambda: f(s, b, h, a, tp=t, sp=True, recompute="selective"),
            "tp_full": lambda: f(s, b, h, a, tp=t, recompute="full"),
            "tp_sp_full": lambda: f(s, b, h, a, tp=t, sp=True, recompute="full"),
            "tp_sp_keep_gathered": lambda: f(s, b, h, a, tp=t, sp=True) + 4 * s * b * h * (1 - 1 / t)}[row]()


def _table_block(row, cfg, dev, dtype):
    """The block for one row of the table, and whether it takes this rank's s/t tokens."""
    block = sp_layers._block(cfg, dev, dropout=0.1).to(dtype).train()
    if row == "none":
        return block, False
    if row in ("tp", "tp_selective", "tp_full"):
        megatron.parallelize_attention(block.attn, None), megatron.parallelize_mlp(block.mlp, None)
        if row == "tp_selective":
            recompute_attention_core(block)
        return block, False
    sp_layers.parallelize_block(block, None, regather=row != "tp_sp_keep_gathered")
    if row == "tp_sp_selective":
        recompute_attention_core(block)
    return block, True


def activation_table(rank, world_size, b=2, s=12, hidden=48, n_head=12, dtype=torch.bfloat16):
    """Saved-for-backward bytes of one block on this rank for each row of `ROWS` (bf16 activations,
    1-byte dropout masks, dropout 0.1 as Table 2 assumes), beside `table_formula`.

    Each row: measured (`memory.saved_for_backward`), formula, layernorm_stats (the mean and 1/std
    a CPU LayerNorm keeps per token, which the table leaves out: measured = formula + layernorm_stats)
    and tokens (the tokens this rank's LayerNorms saw).
    """
    cfg, dev, t = tp.config(hidden=hidden, n_head=n_head), launch.device(), world_size
    megatron.check_degree(cfg, t)
    stat = activations.layernorm_stat_bytes(hidden, dtype, dev)
    x = torch.randn(b, s, hidden, generator=torch.Generator().manual_seed(1)).to(dev, dtype)  # (B, s, H)
    out = {}
    for row in ROWS:
        block, split = _table_block(row, cfg, dev, dtype)
        xi = (x[:, sp_layers._tokens(s, t, rank)] if split else x).clone().requires_grad_()
        with memory.saved_for_backward(block) as saved:
            checkpoint(block, xi, use_reentrant=True) if row.endswith("full") else block(xi)
        tokens = xi.size(0) * xi.size(1)
        formula = round(table_formula(row, s, b, hidden, n_head, t), 6)   # 34/t in floats: 18816.000000000004
        out[row] = {"measured": saved.bytes, "formula": formula,
                    "layernorm_stats": 0 if row.endswith("full") else 2 * tokens * stat, "tokens": tokens}
    return out
