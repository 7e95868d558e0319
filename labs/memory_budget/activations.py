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


def gpt3_activation_bytes_per_layer(s, b, h, a, tp=1, sp=False, recompute="none", dropout=True,
                                    attention="materialized"):
    """Korthikanti et al. 2022, Table 2, the GPT-3 block: 16-bit activations, 1-byte dropout masks,
    a 4h GeLU MLP and materialized s x s scores: sbh(34 + 5as/h) with no parallelism.

    With dropout off the three masks go (2sbh + a*s*s*b) and the attention dropout output no longer
    differs from the softmax output (2*a*s*s*b): 32 + 2as/h. Not a Llama block: see `llama_activation_terms`.
    ``attention="flash"``: a fused kernel (FlashAttention, Dao et al. 2022) keeps no s x s tensor, only
    its output and an fp32 log-sum-exp per query and head (4sba), and draws its dropout mask from a
    seed: 34sbh + 4sba (chapter 9 measures the 34). Full recomputation keeps each layer's input, 2sbh,
    and under sequence parallelism only the rank's s/tp rows of it (Korthikanti et al. 2022, §4.2.2;
    chapter 6 measures 2sbh/t).
    """
    _check_recompute(recompute)
    if recompute == "full":
        return 2 * s * b * h / tp if sp and tp > 1 else 2 * s * b * h  # each layer's input (s/tp rows)
    if recompute in ("selective_ops", "mlp"):
        raise ValueError(f"{recompute} is a policy for a Llama block; for the GPT-3 block use 'selective'.")
    linear, scores = (34, 5) if dropout else (32, 2)
    replicated = 0 if sp else 10 if dropout else 8  # LayerNorm inputs, dropout masks, QKV/FC inputs
    per_token = replicated + (linear - replicated) / tp
    if attention == "flash":
        return s * b * h * per_token + (0 if recompute == "selective" else 4 * s * b * a / tp)
    attention_bytes = 0 if recompute == "selective" else scores * a * s / (h * tp)
    return s * b * h * (per_token + attention_bytes)


activation_bytes_per_layer = gpt3_activation_bytes_per_layer  # the name chapters 1 and 4 call


RECOMPUTE = ("none", "selective", "selective_ops", "mlp", "full")


def _check_recompute(recompute):
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}.")


def llama_activation_terms(s, b, h, a, kv_heads, ffn, tp=1, sp=False, recompute="none",
                           attention="materialized", mlp="swiglu", head_dim=None):
    """Bytes one Llama block saves for backward, term by term: bf16 activations, fp32 norm statistics.

    What each op keeps (s tokens, b sequences, h hidden, a query heads of d = h/a, k KV heads, f the
    SwiGLU width; each proven exactly on `labs.model.LlamaBlock` by `measure_llama_activations`):

        attention_norm, ffn_norm   RMSNorm keeps its input and 1/rms per token  2 x (2sbh + 4sb)
        wq, wk, wv                 their common input                           2sbh
        RoPE                       multiplies by cos/sin buffers, keeps them    0
        q                          the rotated queries                          2sbh
        k, v                       flash: k heads; materialized: copied to a    4sbh k/a | 4sbh
        scores (materialized)      the softmax output, s x s per head           2as^2b
        log-sum-exp (flash)        one fp32 number per query and head           4sba
        attention output           wo's input. SDPA saves its output too, but it
                                   is the same storage: q arrives as a (b, s, a, d)
                                   transpose and the output keeps that layout, so
                                   the transpose back to (b, s, h) is a view    2sbh
        w1, w3                     their common input                           2sbh
        SwiGLU                     x w1 (SiLU), SiLU(x w1) and x w3 (product),
                                   the product (w2's input)                     8sbf
        residual adds              nothing                                      0

    flash:        sbh(12 + 4k/a) + 8sbf + sb(8 + 4a)
    materialized: sbh(16 + 2as/h) + 8sbf + 8sb      (Llama has no dropout and no 4h GeLU MLP)
    recompute="selective" recomputes the attention core (Korthikanti et al. 2022, §5) from q, k, v: scores and
    log-sum-exp go, k and v stay at k heads. "full" keeps only the layer input, 2sbh (2sbh/tp under
    sequence parallelism: the rank's rows). "selective_ops" is torchtitan's per-op policy (9dec370,
    parallelize_llama.py ``_save_list``): the block's input, the outputs of every other matmul (wq, wv,
    w1, w2 in a Llama block's order), the attention's output and log-sum-exp, and the reduce-scatters'
    outputs under sequence parallelism; the rest is recomputed. "mlp" reruns the MLP (or MoE) block from
    its input (Megatron-Core's ``--recompute-modules mlp`` / ``moe``): its own terms go. Under tensor
    parallelism (Shoeybi et al.
    2019) heads and f split over tp; the norms, their statistics and the projections' inputs are
    replicated unless sequence parallelism (sp) splits them too; KV heads are replicated when tp exceeds
    them. Heads wider than h/a (``head_dim``: Qwen3) make q, k, v and the attention output a d wide.
    ``mlp``: "swiglu", or a two-matrix MLP of width f ("squared_relu", "gelu": its input and output, 4sbf;
    "relu": its output, 2sbf), derived, not measured.
    Not in the formula, and measured as more: an unfused RMSNorm (fp32 copies, `rmsnorm_saved_bytes`),
    a softmax kept in fp32 (Hugging Face's eager attention), dropout. The embedding, the logits and
    the loss sit outside the blocks.
    """
    _check_recompute(recompute)
    if attention not in ("materialized", "flash"):
        raise ValueError(f"attention must be 'materialized' or 'flash', got {attention!r}.")
    whole = tp if sp else 1                      # without sp, every tp rank holds these in full
    if recompute == "full":
        return {"layer_input": 2 * s * b * h / whole if whole > 1 else 2 * s * b * h}
    sbh, sb, d = s * b * h, s * b, head_dim or h // a
    sbq = s * b * a * d                          # q and the attention output: a heads of d
    kv_local = kv_heads / tp if kv_heads >= tp else 1
    mlp_bytes = {"swiglu": 8, "squared_relu": 4, "gelu": 4, "relu": 2}[mlp] * sb * ffn / tp
    if recompute == "selective_ops":
        return {"layer_input": 2 * sbh / whole, "q": 2 * sbq / tp, "v": 2 * sb * d * kv_local,
                "w1": 2 * sb * ffn / tp, "w2_out": 2 * sbh, "attention_output": 2 * sbq / tp,
                "logsumexp": 4 * sb * a / tp, "reduce_scatter": 2 * 2 * sbh / tp if sp else 0}
    terms = {"norm_inputs": 2 * 2 * sbh / whole, "norm_stats": 2 * 4 * sb / whole,
             "attention_input": 2 * sbh / whole, "q": 2 * sbq / tp,
             "k_v": 2 * 2 * sb * d * kv_local, "attention_output": 2 * sbq / tp,
             "mlp_input": 2 * sbh / whole, "swiglu" if mlp == "swiglu" else "mlp": mlp_bytes}
    if recompute == "mlp":                       # the MLP (or MoE) block rerun from its input in backward
        terms.pop("swiglu" if mlp == "swiglu" else "mlp")
    if recompute in ("none", "mlp") and attention == "flash":
        terms["logsumexp"] = 4 * sb * a / tp
    if recompute in ("none", "mlp") and attention == "materialized":
        terms["k_v"] = 2 * 2 * sbq / tp          # repeated to the a query heads before q k^T
        terms["scores"] = 2 * a * s * s * b / tp
    return terms


def llama_activation_bytes_per_layer(s, b, h, a, kv_heads, ffn, tp=1, sp=False, recompute="none",
                                     attention="materialized", **shape):
    """The sum of `llama_activation_terms` (``shape``: its ``mlp`` and ``head_dim``)."""
    terms = llama_activation_terms(s, b, h, a, kv_heads, ffn, tp, sp, recompute, attention, **shape)
    return sum(terms.values())


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
    _check_recompute(recompute)
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


