"""Chapter 3: what each ZeRO-style recipe keeps per parameter, per rank, as formulas.

- ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054, section 3.1 and Figure 1): mixed-precision
  Adam keeps 2 + 2 + K = 12 bytes per parameter, 16 in all; stage 3 shards all of it: 16/d.
- Megatron-LM's distributed optimizer (Megatron Core developer guide, "Distributed Optimizer")
  shards only the optimizer's fp32 state and keeps the weights and the main gradients whole.
- FSDP2 keeps the sharded fp32 parameter (the master), its fp32 gradient shard and Adam's two fp32
  moments: (4 + 4 + 8)/d. Chapter 3's lab measures these from FSDP2's DTensor shards
  (`labs.zero.distributed_optimizer`).
"""


RECIPES = {   # bytes per parameter per rank as (whole, sharded over d): whole + sharded / d
    "ZeRO-3 (fp16/bf16 + fp32 Adam)": (0, 16),
    "Megatron dist. opt., bf16 params + fp32 grads": (6, 12),
    "Megatron dist. opt., fp16 params + fp16 grads": (4, 16),
    "Megatron dist. opt., fp32 params + fp32 grads": (8, 8),
    "FSDP2, fp32 shards + bf16 compute": (0, 16),
}


FSDP2_PIECES = {"params": 4, "grads": 4, "adam_moments": 8}   # bytes per sharded element


def fsdp2_local_rows(rows, d, r):
    """Rows of a weight's dim 0 that FSDP2's Shard(0) gives rank r of d: chunks of ceil(rows/d), the
    last ones short or empty (``torch.chunk``; the storage is padded to ceil(rows/d) rows)."""
    if not 0 <= r < d:
        raise ValueError(f"rank {r} is not one of the d = {d} ranks.")
    chunk = -(-rows // d)
    return max(0, min(chunk, rows - r * chunk))


def bytes_per_param(recipe, d):
    """The formula: whole + sharded / d bytes per parameter on each of d data-parallel ranks."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; use one of {', '.join(RECIPES)}.")
    if d < 1:
        raise ValueError(f"d must be a positive data-parallel size, got {d}.")
    whole, sharded = RECIPES[recipe]
    return whole + sharded / d


def table(ds=(1, 8, 64)):
    """{recipe: [bytes per parameter at each d]}: the formulas side by side."""
    return {name: [bytes_per_param(name, d) for d in ds] for name in RECIPES}
