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
the forward's two), at eta times its kernel's speed relative to a GEMM's (`attention_ratio`, from
published utilizations, not fitted); scores written out cost the whole s and twice the forward, at eta.

A mixture of experts also permutes its tokens to their experts and back (`permutation_bytes`: the
bytes Megatron-Core's permute and unpermute move, counted from its code), at the memory's bandwidth.

The rest of the layer (norms, activation functions, residual adds, RoPE, softmax) is memory-bound:
its time is the bytes it moves over BW_HBM. A fused stack (Transformer Engine, torch.compile) moves
at least three times the bytes the layer saves for backward (chapter 1's formulas): each saved tensor
is written in forward, read in backward, and its gradient written. An eager stack runs each op on
its own: `EAGER_TRAFFIC` is every non-matmul op's inputs and outputs, forward and backward, on the
tiny Llama block, against the bytes it saves, as chapter 14's lab counts them with a dispatch mode
(`labs.planning.eager_traffic`, which tests/test_planner_model.py runs again to check this record).
"""
import functools
import math

from labs.formulas import activations
from labs.formulas.planning import memory

E = 2                  # bytes of a 16-bit element
# A fused attention kernel's speed relative to the best GEMM on the same GPU, each as a share of the BF16
# peak its authors or a public benchmark report: FlashAttention-2 "reaching 50-73% of the theoretical
# maximum FLOPs/s on A100" (Dao 2023, abstract; the low end, its backward) and "only 35% utilization on
# the H100" (Shah et al. 2024, FlashAttention-3, abstract); FlashAttention-3 at head dimension 128, the
# Llama and Qwen heads' (its abstract's "up to 740 TFLOPs/s (75% utilization)" is head dimension 256):
# 620.7 TFLOP/s at 16k tokens (pytorch/benchmark, below) of the 989 peak, the class of cuDNN's fused
# attention Transformer Engine runs; the
# largest GEMMs reach 85.9 % of the A100's peak and 80.1 % of the H100's (maximum achievable matmul
# FLOPS, stas00/ml-engineering compute/accelerator/README.md at 7376725, January 2025; later
# versions print 86.9 % and 80.3 %, which would move the attention ratios by at most about 1 %).
# Attention runs at eta times this ratio: the stack's efficiency, slowed by its kernel's gap to a
# GEMM. Not fitted. Scores written out: eta.
MAMF = {"A100": 0.859, "RTX 3090": 0.859, "H100": 0.801, "H100 96GB 500W": 0.801}
KERNEL = {("flash2", "A100"): 0.50, ("flash2", "RTX 3090"): 0.50, ("flash2", "H100"): 0.35,
          ("flash2", "H100 96GB 500W"): 0.35, ("flash3", "H100"): 620.7 / 989,
          ("flash3", "H100 96GB 500W"): 620.7 / 989}


# The same kernels at shorter sequences, TFLOP/s forward on an H100 SXM5, head dim 128, 16k tokens per call
# (batch x sequence), at sequence 512, 1k, 2k, 4k, 8k, 16k: FlashAttention-3 as pytorch/benchmark measured it
# (commit ff65cb67, PR #2391: flash_v3, 430 to 621), FlashAttention-2 as Shah et al. 2024 print it (Figure 5,
# head dim 128: 309 to 370). A call attends over s / cp keys at a time (a ring step of context parallelism),
# so short chunks run below the long-sequence speed above; measured on Hopper only, so only Hopper gets it.
BY_LENGTH = {"flash3": (430.3, 517.1, 565.5, 590.2, 614.2, 620.7), "flash2": (309, 350, 362, 368, 370, 370)}
HOPPER = ("H100", "H100 96GB 500W")


def length_factor(attention, generation, length):
    """A fused attention kernel's speed at ``length`` keys per call over its speed at 16k (`BY_LENGTH`),
    linear in log2 of the length between the measured points, 1 above them; held at the 512 point below
    it (optimistic there); 1 off Hopper or for a kernel not measured."""
    curve = BY_LENGTH.get(attention if generation in HOPPER or attention != "flash3" else "flash2")
    if generation not in HOPPER or curve is None or length >= 16384:
        return 1.0
    x = min(max(math.log2(length) - 9, 0.0), 5.0)       # 512 -> 0, 16k -> 5
    i = min(int(x), 4)
    return (curve[i] + (x - i) * (curve[i + 1] - curve[i])) / curve[-1]


def attention_ratio(attention, generation, length=16384):
    """A fused attention kernel's speed over the best GEMM's on the same GPU (see above) at ``length`` keys
    per call (`length_factor`); FlashAttention-3 runs on Hopper only, so elsewhere a stack that asks for it
    runs FlashAttention-2."""
    kernel = attention if (attention, generation) in KERNEL else "flash2"
    return min(1.0, KERNEL[kernel, generation] / MAMF[generation]) * length_factor(kernel, generation, length)


FUSED_PASSES = 3       # write, read back, write the gradient: the least a fused stack moves
# (bytes the eager ops of one Llama block move, bytes the block saves for backward), b = 2, s = 64, h = 256,
# 8 heads, 2 KV heads, f = 896: counted by `labs.planning.eager_traffic.count` under torch 2.13.0, which
# tests/test_planner_model.py runs again; integers of bytes, so the record is exact
EAGER_TRAFFIC = (15_750_144, 1_348_608)
EAGER_TRAFFIC_TORCH = "2.13"


def eager_traffic_ratio():
    """Bytes the eager ops of one Llama block move per byte it saves (`EAGER_TRAFFIC`)."""
    return EAGER_TRAFFIC[0] / EAGER_TRAFFIC[1]


def gemm_seconds(M, N, K, flops, hbm_bw, k0=0.0):
    """One GEMM of (M x K) @ (K x N) on the roofline, at ``flops`` per second on a long reduction; ``k0``:
    a grouped GEMM's fixed cost per output tile in steps of its reduction (`GROUPED_K0`), 0 for a dense
    one."""
    return max(2 * M * N * (K + k0) / flops, E * (M * K + N * K + M * N) / hbm_bw)


def gemm_passes(M, N, K, flops, hbm_bw, k0=0.0):
    """(forward, backward) seconds of a weight's GEMMs: forward (M x K) @ (K x N) reduces over K; backward
    the input's gradient (M x N) @ (N x K) over N and the weight's (K x M) @ (M x N) over M, each of the
    forward's FLOPs and bytes."""
    return (gemm_seconds(M, N, K, flops, hbm_bw, k0),
            gemm_seconds(M, K, N, flops, hbm_bw, k0) + gemm_seconds(K, N, M, flops, hbm_bw, k0))


# The experts' grouped GEMM by its shape. DeepGEMM's README (deepseek-ai/DeepGEMM at a6d97a1c, "Grouped GEMMs
# for MoE models (contiguous layout)", FP8 on H800, 8 groups of M = 4,096) prints 1,288 TFLOP/s at N = 4,096,
# K = 7,168 and 1,093 at N = 7,168, K = 2,048. Each output tile's fixed cost worth K_0 steps of its reduction,
# K / (K + K_0), fits the two rows at K_0 = 551 (solved by `_solve_k0`, not fitted on a training run). BF16
# walks its reduction at half the FP8 rate: K_0 / 2 (assumed; DeepGEMM prints FP8 only). Only the experts get
# it: the dense GEMMs' shape is in the eta fitted on them (a dense per-shape term was tried and lost, see
# `DENSE_K0`); an expert's GEMM narrows as tensor parallelism slices it (K = f_e / tp for its
# second weight, N = f_e / tp its first) and as the tokens spread over more experts (its weight gradient
# reduces over the expert's M tokens).
DEEPGEMM_GROUPED = ((2048, 1093.0), (7168, 1288.0))     # (K, TFLOP/s), 8 groups of M = 4,096


def _solve_k0(rows=DEEPGEMM_GROUPED):
    """K_0 with (K_a / (K_a + K_0)) / (K_b / (K_b + K_0)) equal to the ratio of the two rows' TFLOP/s."""
    (ka, fa), (kb, fb) = rows
    r = fa / fb
    return ka * kb * (1 - r) / (r * kb - ka)


GROUPED_K0 = _solve_k0()


def grouped_k0(fp8):
    """K_0 of an expert's grouped GEMM of this precision (`DEEPGEMM_GROUPED`)."""
    return GROUPED_K0 if fp8 else GROUPED_K0 / 2


# The same per-tile cost on the dense GEMMs: 0, left out. K_0 = 797 solved from DeepGEMM's dense FP8 rows
# (a6d97a1c, "Normal GEMMs for dense models") was tried, BF16 at half, and lost on the checked set
# (`labs.planning.trials` reruns it in a fresh process; nothing sets this in the model itself).
DENSE_K0 = 0.0


def dense_k0(fp8):
    """K_0 of a dense GEMM of this precision: `DENSE_K0` in FP8, half in BF16 (assumed)."""
    return DENSE_K0 if fp8 else DENSE_K0 / 2


@functools.lru_cache(maxsize=None)
def layer_seconds(model, cluster, eta, fp8, eager, kernels, moe_layer, tokens, tp, ep, sp, recompute,
                  attention="flash2",
                  permute_fused=False, cp=1):
    """Seconds one layer takes on one rank for a micro-batch of ``tokens`` (b s / cp) tokens:
    {"forward", "backward", "recompute", "gemm", "attention"} (the last two, forward and backward,
    are what the tensor- and context-parallel collectives can hide under)."""
    mm_flops = eta * (cluster.fp8_flops if fp8 else cluster.peak_flops)
    i = next(j for j in range(model.layers) if model.is_moe_layer(j) == moe_layer)
    gemm_f, gemm_b, half, mlp = 0.0, 0.0, 0.0, 0.0
    attention_names = {w.name for w in model.attention_weights()}
    for n, w in enumerate(x for x in model.layer_weights(i) if len(x.shape) == 2):
        out, inn = w.shape
        N = {"col": -(-out // tp), "kv": out * max(model.kv_heads // tp, 1) // model.kv_heads}.get(w.split,
                                                                                                   out)
        K = inn // tp if w.split == "row" else inn
        if w.expert:            # each of the rank's experts gets its share of the ep group's routed tokens:
            # the tp ranks of a group hold 1/tp of each expert and all of its micro-batch's tokens (gathered
            # after the dispatch under sequence parallelism; with experts folded over tp x dp each rank holds
            # whole experts and the same M), so a rank does 1/tp of its group's expert FLOPs
            per_expert = tokens * model.top_k * ep / model.experts
            t, tb = (w.copies / ep * x for x in gemm_passes(max(per_expert, 1), N, K, mm_flops,
                                                            cluster.hbm_bw, grouped_k0(fp8)))
        else:
            M = tokens // tp if (w.split == "rep" and sp and tp > 1) else tokens
            t, tb = gemm_passes(M, N, K, mm_flops, cluster.hbm_bw, dense_k0(fp8))
        gemm_f, gemm_b = gemm_f + t, gemm_b + tb
        half += t if n % 2 else 0        # torchtitan's per-op policy recomputes every other matmul
        mlp += 0 if w.name in attention_names else t
    causal = kernels != "materialized"
    ratio = attention_ratio(attention, cluster.generation, model.seq // cp) if causal else 1.0
    attn_flops = eta * cluster.peak_flops * ratio
    attn_f = 4 * tokens * model.seq / (2 if causal else 1) * model.attention_width / tp / attn_flops
    attn_b = attn_f * (2.5 if causal else 2)
    passes = FUSED_PASSES if not eager else eager_traffic_ratio()
    saved = memory.layer_bytes(model, kernels, moe_layer, 1, tp, 1, "none", sp) * tokens / model.seq
    ew = passes * saved / cluster.hbm_bw
    perm = permutation_bytes(model, tokens // (tp if sp else 1), ep, permute_fused) / cluster.hbm_bw \
        if moe_layer else 0.0
    forward = gemm_f + attn_f + ew / 3 + perm
    redo = {"none": 0.0, "selective": attn_f, "selective_ops": half + ew / 3, "mlp": mlp + ew / 6 + perm,
            "full": forward}[recompute]
    return {"forward": forward, "backward": gemm_b + attn_b + 2 * ew / 3 + perm, "recompute": redo,
            "gemm": gemm_f + gemm_b, "attention": attn_f + attn_b}


# Token permutation, counted from the code that runs it. Megatron-Core's (NVIDIA/Megatron-LM f2e5db40,
# megatron/core/transformer/moe/moe_utils.py): `permute` is an index_select of the k copies of each token
# (reads and writes T k h elements); `unpermute` zero-fills a T k h buffer, index_copy_s into it, multiplies
# by the routing probabilities and sums over k (six passes over T k h). The alltoall dispatcher
# (token_dispatcher.py) permutes before the all-to-all and again, by local expert, after it, and unpermutes
# twice. Fused (Transformer Engine's moe_permute / moe_unpermute, `--moe-permute-fusion`): the permute reads
# each token once and writes its k copies, (1 + k) T h; the unpermute reads the k copies and writes their
# weighted sum, (k + 1) T h; the sort by local expert reads and writes T k h each way.
def permutation_bytes(model, routed, ep, fused=False):
    """Bytes one MoE layer's token permutation moves in forward (backward moves as many), for ``routed``
    tokens routed on the rank (its sequence-parallel share): memory-bound, at the HBM's bandwidth. The
    sort by local expert runs only when a rank holds more than one expert."""
    k, local = model.top_k, model.experts // ep > 1
    elements = (2 * (1 + k) + (4 * k if local else 0)) if fused else (8 * k + (8 * k if local else 0))
    return elements * routed * model.hidden * E


@functools.lru_cache(maxsize=None)
def head_seconds(model, cluster, eta, fp8, tokens, tp):
    """The output layer (a vocabulary-parallel GEMM of h x V/tp, forward and backward) and its loss,
    memory-bound over chapter 1's tail bytes, twice (forward, backward)."""
    mm_flops = eta * (cluster.fp8_flops if fp8 else cluster.peak_flops)
    vocab = -(-model.vocab // tp)
    gemm = sum(gemm_passes(tokens, vocab, model.hidden, mm_flops, cluster.hbm_bw, dense_k0(fp8)))
    loss = 2 * activations.tail_forward_peak_bytes(tokens, 1, -(-model.vocab // tp), E, target_copy=False)
    return gemm + loss / cluster.hbm_bw
