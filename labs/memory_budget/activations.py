"""Chapter 1, activation memory: what one transformer block saves for backward, as a formula and
as a measurement of the bytes autograd keeps (`labs.measure.memory.saved_for_backward`).

Two blocks, two formulas, each proven exactly on the tiny model (`labs.model`) at several shapes:
- the GPT-3 block of Korthikanti et al. 2022 (arXiv 2205.05198, Table 2): 16-bit activations,
  1-byte dropout masks, a 4h GeLU MLP and materialized s x s scores, sbh(34 + 5as/h);
- the Llama block (Touvron et al. 2023): no dropout, RMSNorm, RoPE, grouped-query attention, a
  SwiGLU MLP, and attention either materialized or through a fused kernel that keeps only its
  output and the softmax log-sum-exp (FlashAttention, Dao et al. 2022, arXiv 2205.14135; on a CPU
  ``F.scaled_dot_product_attention`` runs such a kernel): `llama_activation_terms`.

`labs.memory_budget.budget` multiplies these by the layers of real models.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from labs.measure import memory
from labs import model as tiny
from labs.formulas.activations import (  # the formulas' home is the torch-free core
    RECOMPUTE as RECOMPUTE, check_recompute as check_recompute,
    activation_bytes_per_layer as activation_bytes_per_layer,
    gpt3_activation_bytes_per_layer as gpt3_activation_bytes_per_layer,
    llama_activation_bytes_per_layer as llama_activation_bytes_per_layer,
    llama_activation_terms as llama_activation_terms)


# --- the lab: bytes autograd saves, measured -----------------------------------------------------

def layernorm_stat_bytes(h=8, dtype=torch.bfloat16, device="cpu"):
    """Bytes per token LayerNorm keeps beside its input (mean and 1/std), measured on ``device``:
    2 x 2 in bf16 on a CPU; a GPU kernel may keep them in fp32."""
    ln = torch.nn.LayerNorm(h).to(device=device, dtype=dtype)
    x = torch.randn(1, 1, h, dtype=dtype, device=device, requires_grad=True)
    with memory.saved_for_backward(ln) as saved:
        ln(x)
    return saved.bytes - h * x.element_size()


def measure_activations(cfg, shapes, dtype=torch.bfloat16, device="cpu"):
    """Saved-for-backward bytes of one block at each (b, s), beside the formula."""
    rows = []
    stat_bytes = layernorm_stat_bytes(cfg.hidden, dtype, device)
    for b, s in shapes:
        block = tiny.Block(cfg).to(device=device, dtype=dtype).train()
        x = torch.randn(b, s, cfg.hidden, dtype=dtype, device=device, requires_grad=True)
        with memory.saved_for_backward(block) as saved:
            block(x)
        formula = activation_bytes_per_layer(s, b, cfg.hidden, cfg.n_head, dropout=cfg.dropout > 0)
        rows.append({"b": b, "s": s, "measured": saved.bytes, "formula": formula,
                     "layernorm_stats": 2 * s * b * stat_bytes})  # two LayerNorms per block
    return rows


def rmsnorm_saved_bytes(h=8, dtype=torch.bfloat16, device="cpu"):
    """Bytes per token an RMSNorm keeps for backward, measured: the fused one the Llama formula
    assumes (`labs.model.RMSNorm`: its input and an fp32 1/rms, 2h + 4 in bf16) beside
    ``torch.nn.RMSNorm``, which on a CPU decomposes into pow/mean/rsqrt/mul and keeps an fp32 copy
    of its input and the fp32 normalized input as well (8h + 4)."""
    x = torch.randn(1, 1, h, dtype=dtype, device=device, requires_grad=True)
    out = {}
    for name, norm in (("fused", tiny.RMSNorm(h)), ("torch.nn.RMSNorm", torch.nn.RMSNorm(h, eps=1e-5))):
        norm = norm.to(device=device, dtype=dtype)
        with memory.saved_for_backward(norm) as saved:
            norm(x)
        out[name] = saved.bytes
    return out


class AttentionOps(TorchDispatchMode):
    """Names the aten attention ops that run: which kernel F.scaled_dot_product_attention picked."""

    def __enter__(self):
        self.ops = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.__name__:
            self.ops.add(func.__name__)
        return func(*args, **(kwargs or {}))


def recompute_attention_core(block):
    """Selective recomputation (Korthikanti et al. 2022, §5), applied from outside the model: the
    attention core runs under a reentrant checkpoint, which saves only its inputs q, k, v (through
    save_for_backward, where `memory.saved_for_backward` sees them; the non-reentrant checkpoint
    keeps them out of sight of saved-tensor hooks) and recomputes scores or log-sum-exp in backward."""
    core = block.attn.core
    block.attn.core = lambda q, k, v: checkpoint(core, q, k, v, use_reentrant=True)
    return block


def measure_llama_activations(cfg, shapes, recompute="none", dtype=torch.bfloat16, device="cpu"):
    """Saved-for-backward bytes of one `LlamaBlock` at each (b, s), beside `llama_activation_terms`.

    Rows: b, s, measured, formula, terms, kernels (the aten attention ops that ran). On a CPU,
    SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``: it saves q, k and v (at the KV
    heads: GQA without copies), its output and an fp32 log-sum-exp per query and head.
    """
    check_recompute(recompute)
    attention = "flash" if cfg.attention == "sdpa" else "materialized"
    rows = []
    for b, s in shapes:
        torch.manual_seed(0)
        block = tiny.LlamaBlock(cfg).to(device=device, dtype=dtype)
        if recompute == "selective":
            recompute_attention_core(block)
        x = torch.randn(b, s, cfg.hidden, dtype=dtype, device=device, requires_grad=True)
        with memory.saved_for_backward(block) as saved, AttentionOps() as ops:
            checkpoint(block, x, use_reentrant=True) if recompute == "full" else block(x)
        terms = llama_activation_terms(s, b, cfg.hidden, cfg.n_head, cfg.n_kv_head, cfg.ffn,
                                       recompute=recompute, attention=attention)
        rows.append({"b": b, "s": s, "measured": saved.bytes, "formula": sum(terms.values()), "terms": terms,
                     "kernels": sorted(ops.ops)})
    return rows


def measure_llama(shapes=((1, 8), (2, 5), (2, 16)), device="cpu"):
    """Every attention kind and recomputation mode on the tiny Llama block (GQA: 4 query heads, 2 KV
    heads, RoPE on): {"sdpa/none": rows, ...}."""
    return {f"{attention}/{mode}": measure_llama_activations(tiny.LlamaConfig(attention=attention), shapes,
                                                             mode,
                                                              device=device)
            for attention in ("sdpa", "materialized") for mode in ("none", "selective", "full")}


# --- FlashAttention: the s^2 term, measured present and absent -------------------------------------

def attention_core_saved(s_values=(4, 8, 12, 16), b=2, cfg=None, dtype=torch.bfloat16, device="cpu"):
    """Bytes the attention core alone (`LlamaAttention.core`: q, k, v in, output out) keeps for
    backward at each s, with the scores written out and with SDPA's fused kernel, and the s^2
    coefficient read off the measurements by second differences (equally spaced s: f(s + 2D) -
    2f(s + D) + f(s) = 2 alpha D^2 for f = alpha s^2 + beta s + gamma).

    Formulas (h = a d, k KV heads): materialized q, the copies of k and v at a heads, the softmax
    output: 6bsh + 2abs^2, so alpha = 2ab; fused: q, k and v (k heads), the output, an fp32 log-sum-exp
    per query and head: 4bsh + 4bskd + 4bsa, alpha = 0 (Dao et al. 2022, arXiv 2205.14135, §3.1).
    """
    cfg = cfg or tiny.LlamaConfig(seq_len=max(s_values))
    steps = {j - i for i, j in zip(s_values, s_values[1:])}
    if len(s_values) < 3 or len(steps) != 1 or max(s_values) > cfg.seq_len:
        raise ValueError(f"s_values must be 3 or more equally spaced lengths up to seq_len={cfg.seq_len}, "
                         f"got {s_values}.")
    (step,) = steps
    a, kv, d = cfg.n_head, cfg.n_kv_head, cfg.hidden // cfg.n_head
    out = {}
    for attention in ("materialized", "sdpa"):
        attn = tiny.LlamaAttention(tiny.LlamaConfig(**{**cfg.__dict__, "attention": attention})).to(device)
        rows = []
        for s in s_values:
            q, k, v = (torch.randn(b, n, s, d, dtype=dtype, device=device, requires_grad=True)
                       for n in (a, kv, kv))
            with memory.saved_for_backward(attn) as saved:
                attn.core(q, k, v)
            h = q.size(1) * q.size(-1)            # sizes from the tensors the core ran on
            formula = (6 * b * s * h + 2 * a * b * s * s if attention == "materialized"
                       else 4 * b * s * h + 4 * b * s * kv * d + 4 * b * s * a)
            rows.append({"s": s, "measured": saved.bytes, "formula": formula})
        f = [r["measured"] for r in rows]
        second = {(f[i + 2] - 2 * f[i + 1] + f[i]) / (2 * step ** 2) for i in range(len(f) - 2)}
        out[attention] = {"rows": rows,
                          "s2_coefficient": second.pop() if len(second) == 1 else sorted(second),
                          "s2_formula": 2 * a * b if attention == "materialized" else 0}
    return out


