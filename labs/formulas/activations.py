"""Chapter 1, activation memory as formulas: what a transformer block, and the logits and loss above
the blocks, keep for backward. Chapter 1's labs prove each formula exactly on the tiny models
(`labs.memory_budget.activations`, `logits`, `fused_swiglu`).

- the GPT-3 block of Korthikanti et al. 2022 (arXiv 2205.05198, Table 2): 16-bit activations,
  1-byte dropout masks, a 4h GeLU MLP and materialized s x s scores, sbh(34 + 5as/h);
- the Llama block (Touvron et al. 2023): no dropout, RMSNorm, RoPE, grouped-query attention, a
  SwiGLU MLP, and attention either materialized or through a fused kernel that keeps only its
  output and the softmax log-sum-exp (FlashAttention, Dao et al. 2022, arXiv 2205.14135);
- a fused SwiGLU (Megatron-LM's ``SwiGLUFunction``) keeps 6sbf bytes, not 8sbf;
- the tail (the LM head and an fp32 cross-entropy): 4sbV kept for backward, 10sbV at the forward's
  high-water mark, 12sbV in backward.
"""


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
    check_recompute(recompute)
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


def check_recompute(recompute):
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}.")


def llama_activation_terms(s, b, h, a, kv_heads, ffn, tp=1, sp=False, recompute="none",
                           attention="materialized", mlp="swiglu", head_dim=None):
    """Bytes one Llama block saves for backward, term by term: bf16 activations, fp32 norm statistics.

    What each op keeps (s tokens, b sequences, h hidden, a query heads of d = h/a, k KV heads, f the
    SwiGLU width; each proven exactly on `labs.model.LlamaBlock` by `labs.memory_budget.activations`):

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
    check_recompute(recompute)
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


def swiglu_saved_bytes(s, b, ffn, tp=1, fused=True, act_bytes=2):
    """Bytes the SwiGLU keeps beyond its input x: a = x w1, b = x w3 and w2's input when fused
    (6sbf in bf16), and SiLU(a) as well when not (8sbf); the width is split over tp."""
    return (3 if fused else 4) * act_bytes * s * b * ffn / tp


def llama_fused_mlp_terms(s, b, h, a, kv_heads, ffn, tp=1, sp=False, recompute="none", attention="flash",
                          head_dim=None):
    """`llama_activation_terms` with the SwiGLU term of a fused kernel (6sbf/tp, not 8sbf/tp)."""
    terms = llama_activation_terms(s, b, h, a, kv_heads, ffn, tp, sp, recompute, attention, head_dim=head_dim)
    if "swiglu" in terms:
        terms["swiglu"] = swiglu_saved_bytes(s, b, ffn, tp)
    return terms


def tail_saved_bytes(s, b, h, V, act_bytes=2):
    """Bytes the head and the fp32 cross-entropy keep for backward: e*sbh + 4sbV + 8sb + 4, e the
    activation bytes (2 in bf16: 2sbh + 4sbV + 8sb + 4)."""
    return act_bytes * s * b * h + 4 * s * b * V + 8 * s * b + 4


def tail_backward_peak_bytes(s, b, V):
    """Bytes the tail holds at its high-water mark in backward, above the layers' saved activations, when
    the logits are freed before backward (torchtitan's train step: ``del pred``): the fp32 log-softmax
    kept for backward 4sbV, nll_loss's gradient of it 4sbV and the log-softmax's gradient of its input
    4sbV, alive together in ``_log_softmax_backward_data``: 12sbV, above the forward's 10sbV (counted by
    `memory.PeakMemory` on a bf16 head in tests/test_planner_model.py)."""
    return 12 * s * b * V


def tail_forward_peak_bytes(s, b, V, act_bytes=2, target_copy=True):
    """Bytes the tail allocates above what was live when the head started, at its high-water mark:
    the logits e*sbV, their fp32 copy 4sbV (none when the model is fp32 already: ``.float()`` returns
    the same tensor), the log-softmax 4sbV; the loss and total weight, 8; a targets copy, 8sb."""
    copy = 4 * s * b * V if act_bytes < 4 else 0
    return act_bytes * s * b * V + copy + 4 * s * b * V + 8 + (8 * s * b if target_copy else 0)
