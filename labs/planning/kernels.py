"""Chapter 14: how long one layer computes on one rank, matmul by matmul, on a roofline.

Each weight matrix a token meets is a GEMM of M tokens by its rank-local N x K (tensor parallelism
splits N for column-parallel weights, K for row-parallel ones, chapter 4; a routed expert sees the
tokens its ep group sends it, chapter 7). Forward is one GEMM of 2MNK FLOPs, backward two of the same
size (chapter 1). Each runs at the roofline of its arithmetic intensity (Williams et al. 2009):

    t_GEMM = max(2MNK / (eta * peak), e (MK + NK + MN) / BW_HBM)

eta the one fitted constant per GPU generation and precision (`checked.calibrate`), peak the dense
tensor-core peak of the GEMM's precision (FP8 GEMMs at the FP8 peak; attention stays in BF16), e = 2
bytes. Small M (short micro-batches, context parallelism) or narrow N (GQA's K and V under tensor
parallelism) fall below the roofline's ridge and run at the memory's speed. Attention: q k^T and
scores @ v over the causal half of the keys, 4 T (s/2) a d FLOPs forward for T queries, and 2.5
times that backward (a fused kernel recomputes the scores: chapter 1 counts five products against
the forward's two); scores written out cost the whole s and twice the forward.

The rest of the layer (norms, activation functions, residual adds, RoPE, softmax) is memory-bound:
its time is the bytes it moves over BW_HBM. A fused stack (Transformer Engine, torch.compile) moves
at least three times the bytes the layer saves for backward (chapter 1's formulas): each saved tensor
is written in forward, read in backward, and its gradient written. An eager stack runs each op on
its own: `eager_traffic_ratio` counts every non-matmul op's inputs and outputs, forward and backward,
on the tiny Llama block with a dispatch mode, against the bytes it saves.
"""
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labs import model as tiny
from labs.measure import memory as measured
from labs.memory_budget import logits
from labs.planning import memory

E = 2                  # bytes of a 16-bit element
FUSED_PASSES = 3       # write, read back, write the gradient: the least a fused stack moves
MATMULS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward")
VIEWS = ("view", "_unsafe_view", "t", "transpose", "expand", "permute", "detach", "alias", "slice", "select",
         "unsqueeze", "squeeze", "as_strided", "split", "split_with_sizes", "unbind", "_reshape_alias")


class _Traffic(TorchDispatchMode):
    """Adds up the bytes of the inputs and outputs of every op that is neither a matmul nor a view."""

    def __enter__(self):
        self.bytes = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in MATMULS and name not in VIEWS:
            self.bytes += _nbytes(args) + _nbytes(kwargs or {}) + _nbytes(out)
        return out


def _nbytes(x):
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    if isinstance(x, dict):
        return sum(_nbytes(y) for y in x.values())
    return 0


@functools.lru_cache(maxsize=None)
def eager_traffic_ratio(b=2, s=64):
    """Bytes the eager ops of one Llama block (RMSNorm, RoPE, SwiGLU, residuals; SDPA and the matmuls
    left out) read and write in forward and backward, over the bytes the block saves for backward:
    counted, on a block with Llama 3 8B's proportions (4 query heads per KV head, f = 3.5 h)."""
    cfg = tiny.LlamaConfig(hidden=256, n_head=8, n_kv_head=2, ffn=896, seq_len=s)
    torch.manual_seed(0)
    block = tiny.LlamaBlock(cfg).to(torch.bfloat16)
    x = torch.randn(b, s, cfg.hidden, dtype=torch.bfloat16, requires_grad=True)
    with measured.saved_for_backward(block) as saved:
        block(x)
    with _Traffic() as traffic:
        y = block(x)
        y.backward(torch.ones_like(y))
    return traffic.bytes / saved.bytes


def gemm_seconds(M, N, K, flops, hbm_bw):
    """One GEMM of (M x K) @ (K x N) on the roofline, at ``flops`` per second."""
    return max(2 * M * N * K / flops, E * (M * K + N * K + M * N) / hbm_bw)


@functools.lru_cache(maxsize=None)
def layer_seconds(model, cluster, eta, fp8, eager, kernels, moe_layer, tokens, tp, ep, sp, recompute):
    """Seconds one layer takes on one rank for a micro-batch of ``tokens`` (b s / cp) tokens:
    {"forward", "backward", "recompute", "gemm", "attention"} (the last two, forward and backward,
    are what the tensor- and context-parallel collectives can hide under)."""
    mm_flops = eta * (cluster.fp8_flops if fp8 else cluster.peak_flops)
    i = next(j for j in range(model.layers) if model.is_moe_layer(j) == moe_layer)
    gemm_f, half = 0.0, 0.0
    for n, w in enumerate(x for x in model.layer_weights(i) if len(x.shape) == 2):
        out, inn = w.shape
        N = {"col": -(-out // tp), "kv": out * max(model.kv_heads // tp, 1) // model.kv_heads}.get(w.split, out)
        K = inn // tp if w.split == "row" else inn
        if w.expert:            # each of the rank's experts gets its share of the ep group's routed tokens
            per_expert = tokens // (tp if sp else 1) * model.top_k * ep / model.experts
            t = w.copies / ep * gemm_seconds(max(per_expert, 1), N, K, mm_flops, cluster.hbm_bw)
        else:
            M = tokens // tp if (w.split == "rep" and sp and tp > 1) else tokens
            t = gemm_seconds(M, N, K, mm_flops, cluster.hbm_bw)
        gemm_f += t
        half += t if n % 2 else 0        # torchtitan's per-op policy recomputes every other matmul
    causal = kernels != "materialized"
    attn_f = 4 * tokens * model.seq / (2 if causal else 1) * model.attention_width / tp / (eta * cluster.peak_flops)
    attn_b = attn_f * (2.5 if causal else 2)
    passes = FUSED_PASSES if not eager else eager_traffic_ratio()
    saved = memory.layer_bytes(model, kernels, moe_layer, 1, tp, 1, "none", sp) * tokens / model.seq
    ew = passes * saved / cluster.hbm_bw
    forward = gemm_f + attn_f + ew / 3
    redo = {"none": 0.0, "selective": attn_f, "selective_ops": half + ew / 3, "full": forward}[recompute]
    return {"forward": forward, "backward": 2 * gemm_f + attn_b + 2 * ew / 3, "recompute": redo,
            "gemm": 3 * gemm_f, "attention": attn_f + attn_b}


@functools.lru_cache(maxsize=None)
def head_seconds(model, cluster, eta, fp8, tokens, tp):
    """The output layer (a vocabulary-parallel GEMM of h x V/tp, forward and backward) and its loss,
    memory-bound over chapter 1's tail bytes, twice (forward, backward)."""
    mm_flops = eta * (cluster.fp8_flops if fp8 else cluster.peak_flops)
    gemm = 3 * gemm_seconds(tokens, -(-model.vocab // tp), model.hidden, mm_flops, cluster.hbm_bw)
    loss = 2 * logits.tail_forward_peak_bytes(tokens, 1, -(-model.vocab // tp), E, target_copy=False)
    return gemm + loss / cluster.hbm_bw
