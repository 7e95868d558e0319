"""Chapter 3: what each ZeRO-style recipe keeps per parameter, per rank: formulas beside FSDP2's
measured DTensor shards.

- ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054, section 3.1 and Figure 1): mixed-precision
  Adam keeps 2 (fp16 weights) + 2 (fp16 gradients) + K = 12 (fp32 master weights, momentum,
  variance) bytes per parameter, 16 in all; stage 3 (P_os+g+p) shards all of it: 16/d.
- Megatron-LM's distributed optimizer (Megatron Core developer guide, "Distributed Optimizer",
  table of theoretical bytes per parameter; d = data-parallel size) shards only the optimizer's
  fp32 state (main weights, Adam's two moments: 12/d) and keeps the model's weights and the main
  gradients whole: bf16 weights + fp32 gradients 6 + 12/d; fp16 weights + fp16 gradients 4 + 16/d;
  fp32 weights + fp32 gradients 8 + 8/d.
- FSDP2 (``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16)``) keeps the *sharded
  parameter itself* in fp32 (it is the master: no separate copy), its sharded gradient in fp32
  (reduced in bf16, then cast into the shard's dtype), and Adam's two fp32 moments on the shards:
  (4 + 4 + 8)/d = 16/d, the bf16 weights existing only while a unit is gathered. Same 16/d as
  ZeRO-3, made of different pieces: 4 + 4 fp32 where ZeRO has 2 + 2 + 4.

`fsdp2_state_bytes` measures what FSDP2 keeps from its DTensors' local shards (``to_local()``),
so a rank holding full tensors, bf16 shards or unsharded gradients would show.
"""

from labs.formulas.zero import (  # the formulas' home is the torch-free core
    FSDP2_PIECES as FSDP2_PIECES, RECIPES as RECIPES, bytes_per_param as bytes_per_param, fsdp2_local_rows
    as fsdp2_local_rows, table as table)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def fsdp2_state_bytes(net, opt):
    """What this rank keeps after ``opt.step()`` (gradients still held), by its local shards:
    {params, grads, adam_moments, adam_step (the per-parameter step counters), local_numel,
    dtypes: {piece: dtype name}}. Bytes of the local tensors (`to_local()`), which leave FSDP2's padding
    out: the storages (`memory.storage_bytes`) count it."""
    out = dict.fromkeys(("params", "grads", "adam_moments", "adam_step", "local_numel"), 0)
    dtypes = {}
    for p in net.parameters():
        local = _local(p)
        out["local_numel"] += local.numel()
        out["params"] += local.numel() * local.element_size()
        dtypes["params"] = str(local.dtype)
        if p.grad is not None:
            g = _local(p.grad)
            out["grads"] += g.numel() * g.element_size()
            dtypes["grads"] = str(g.dtype)
        for key, s in opt.state.get(p, {}).items():
            s = _local(s)
            piece = "adam_step" if key == "step" else "adam_moments"
            out[piece] += s.numel() * s.element_size()
            dtypes[piece] = str(s.dtype)
    out["dtypes"] = dtypes
    return out


def check_fsdp2(states, params):
    """Measured against the formula: summed over the d ranks each piece is exactly its bytes per
    element x P (FSDP2's shards tile every parameter exactly), so per rank on average 16 P / d;
    returns {piece: bytes summed over ranks} and the mean bytes per parameter per rank."""
    d = len(states)
    total = {k: sum(s[k] for s in states) for k in FSDP2_PIECES}
    numel = sum(s["local_numel"] for s in states)
    if numel != params:
        raise AssertionError(f"the shards hold {numel} elements, the model {params}")
    for k, per in FSDP2_PIECES.items():
        if total[k] != per * params:
            raise AssertionError(f"{k}: ranks keep {total[k]} bytes, the formula {per} x {params}")
    per_rank = sum(total.values()) / d / params
    return {"total": total, "bytes_per_param_per_rank": per_rank,
            "formula": bytes_per_param("FSDP2, fp32 shards + bf16 compute", d),
            "adam_step_bytes": states[0]["adam_step"]}


def check_replicas(states, shard):
    """HSDP: rank r keeps what rank r mod s keeps (the same shard, replicated across nodes), piece by
    piece, element count and dtypes too; a replica that kept full or bf16 tensors differs."""
    for r, s in enumerate(states):
        if s != states[r % shard]:
            raise AssertionError(f"rank {r} keeps {s}; rank {r % shard}, the same shard, {states[r % shard]}")
