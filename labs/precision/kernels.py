"""Which FP8 matrix-product kernels this build of torch really has: each one tried (chapter 8).

``torch._scaled_mm`` (and, from torch 2.10, ``torch.nn.functional.scaled_mm`` with an explicit
``ScalingType`` per operand) multiplies two FP8 matrices with their *decoding* scales (1 / the
encoding scale of `labs.precision.fp8.quantize`) and accumulates in fp32. Four recipes:
- tensorwise: one scale per operand (Micikevicius et al. 2022);
- rowwise: one per row of X and one per output channel of W;
- blockwise: DeepSeek-V3's 1x128 tiles of X and 128x128 blocks of W (section 3.3.2);
- MXFP8: 1x32 blocks of both with E8M0 scales (OCP MX v1.0; `labs.precision.scaling.mx_quantize`).
`try_kernels` calls each one on the same operands and records what happened: the kernel ran (and
its product's gap to the emulation, dequantise and multiply in fp64, on the *same* FP8 operands,
beside the bound that gap must stay under on that device), or the exact error it raised. Nothing
is claimed for a recipe whose kernel did not run. It probes the GPU where there is one.

The bound differs by device. On a CPU the kernel dequantises and accumulates in fp32:
`GAP_BOUND`. On a Hopper GPU the tensor cores keep only about 14 bits of the running sum of FP8
products (DeepSeek-V3, arXiv 2412.19437, section 3.3.2), and the kernels promote that partial sum
into an fp32 register every N_C = 128 elements of K: DeepSeek-V3's recipe, CUTLASS's FP8 GEMMs
with their default ``mma_promotion_interval`` of 4 WGMMAs of K = 32, and by construction every
blockwise kernel, which must apply each 128-wide block's scales to its own partial sum.
`cuda_gap_bound` derives the bound from that.
"""
import math

import torch
import torch.nn.functional as F

from labs.precision import fp8, scaling

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")


_GROUPS = {"tensorwise": ("tensor", "tensor"), "rowwise": ("row", "row"), "blockwise": ("1x128", "128x128")}


def dequantized(recipe, x, w):
    """The FP8 operands of ``recipe`` dequantised, in fp64: what the kernel multiplies."""
    if recipe == "mxfp8":
        xq, sx, _ = scaling.mx_quantize(x, "ceil")
        wq, sw, _ = scaling.mx_quantize(w, "ceil")
        return scaling.mx_dequantize(xq, sx).double(), scaling.mx_dequantize(wq, sw).double()
    (xq, ex), (wq, ew) = fp8.quantize(x, _GROUPS[recipe][0]), fp8.quantize(w, _GROUPS[recipe][1])
    return fp8.dequantize(xq, ex).double(), fp8.dequantize(wq, ew).double()


def _operands(recipe, x, w):
    """FP8 X (M, K), W^T (K, N) column-major, the decoding scales in the layouts the kernels take
    (tensorwise (), rowwise (M, 1) and (1, N), blockwise (M, K/128) and (K/128, N/128), MX (M, K/32)
    and (N, K/32) in E8M0), the ScalingType names, and the emulated product in fp64."""
    A, B = dequantized(recipe, x, w)
    ref = A @ B.t()
    if recipe == "mxfp8":
        xq, sx, _ = scaling.mx_quantize(x, "ceil")
        wq, sw, _ = scaling.mx_quantize(w, "ceil")
        return xq, wq.t(), sx, sw, ("BlockWise1x32", "BlockWise1x32"), ref
    (xq, ex), (wq, ew) = fp8.quantize(x, _GROUPS[recipe][0]), fp8.quantize(w, _GROUPS[recipe][1])
    M, K = x.shape
    N = w.shape[0]
    if recipe == "tensorwise":
        sx, sw, kinds = (1 / ex).reshape(()), (1 / ew).reshape(()), ("TensorWise", "TensorWise")
    elif recipe == "rowwise":
        sx, sw, kinds = 1 / ex, (1 / ew).reshape(1, N), ("RowWise", "RowWise")
    else:
        (sx, sw), kinds = blockwise_scales(ex, ew), ("BlockWise1x128", "BlockWise128x128")
    return xq, wq.t(), sx.float(), sw.float(), kinds, ref


def blockwise_scales(ex, ew):
    """The decoding scales of X (M, K) per 1x128 tile and of W (N, K) per 128x128 block, from the
    expanded encoding scales `labs.precision.fp8.quantize` returns, in the layout CUDA's
    ``_scaled_mm`` checks (aten/src/ATen/native/cuda/ScaledBlas.cpp, ``is_blockwise_1x128_scaling``
    and ``is_blockwise_128x128_scaling``, W checked as ``b.t()`` with ``scale_b.t()``):
    scale_a (M, K/128) with strides (1, M), outer dimension major; scale_b (K/128, N/128) with
    strides (1, K/128). Newer torch pads the 128x128 scales' row stride to a multiple of 4: with K
    a multiple of 512 both layouts are the same."""
    sa = (1 / ex[:, ::fp8.BLOCK]).float()                       # (M, K/128): one per tile
    sb = (1 / ew[::fp8.BLOCK, ::fp8.BLOCK]).float()              # (N/128, K/128): one per block
    return sa.t().contiguous().t(), sb.contiguous().t()


def _call(a, b, sa, sb, kinds):
    """F.scaled_mm with the recipe named where this torch has it, else the older torch._scaled_mm."""
    if hasattr(F, "scaled_mm"):
        return F.scaled_mm(a, b, sa, getattr(F.ScalingType, kinds[0]), sb, getattr(F.ScalingType, kinds[1]),
                           output_dtype=torch.float32)
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)


def try_kernels(M=256, K=512, N=256, seed=0, device=None):
    """Call every recipe's kernel once on ``device`` (the GPU where there is one, else the CPU).
    Returns {recipe: {"ran": bool, "error": the exception's type and whole message or None, "gap":
    the kernel's relative gap to the emulation on the same FP8 operands, or None where it did not
    run, "gap_bound": the bound for that gap on this device}}, the device and the torch version."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    x = fp8.activations(M, K, seed=seed)                                                    # (M, K)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed + 1)) / math.sqrt(K)  # (N, K)
    out = {}
    for recipe in RECIPES:
        a, b, sa, sb, kinds, ref = _operands(recipe, x, w)
        bound = cuda_gap_bound(*dequantized(recipe, x, w)) if device.type == "cuda" else GAP_BOUND
        try:
            y = _call(a.to(device), b.to(device), sa.to(device), sb.to(device), kinds).cpu()
        except Exception as exc:  # noqa: BLE001 -- any refusal is the finding, recorded word for word
            # whole: past its first line the message lists the configurations the kernel does take
            out[recipe] = {"ran": False, "error": f"{type(exc).__name__}: {str(exc).strip()}", "gap": None,
                           "gap_bound": bound}
            continue
        gap = ((y.double() - ref).norm() / ref.norm()).item()
        out[recipe] = {"ran": True, "error": None, "gap": gap, "gap_bound": bound}
    return {"torch": torch.__version__, "device": str(device), "kernels": out}


# On a CPU both sides multiply the same FP8 values, whose products are exact in fp32; only the order
# of the fp32 additions differs: a few fp32 roundings over K = 512 terms, far below 1e-6 relative.
GAP_BOUND = 1e-6
ACC_BITS = 14          # significant bits the tensor cores keep of a running sum (DeepSeek-V3, 3.3.2)
N_C = 128              # products summed in those bits before the partial sum is promoted to fp32
FP32_U = 2.0 ** -24


def _gamma(n, u):
    """Higham's gamma_n = n u / (1 - n u): recursive summation of n + 1 terms, each addition
    rounded with relative error at most u, errs by at most gamma_n times the sum of magnitudes
    (Higham 2002, "Accuracy and Stability of Numerical Algorithms", section 4.2)."""
    return n * u / (1 - n * u)


def cuda_coefficient(K):
    """c with |kernel - emulation| <= c * sum_k |a_k b_k| for every output, on a Hopper GPU.

    Each block of N_C products is summed in the short accumulator: N_C - 1 additions, each
    truncated to ACC_BITS bits (an error below one unit in the last place, u = 2^(1 - ACC_BITS);
    truncation, not rounding, is the worse case). The K / N_C block sums, each multiplied by its two
    fp32 scales, are added in fp32 and the result stored in fp32: K / N_C + 2 more roundings of
    2^-24. First-order terms only: the product of two gammas is below 1e-6 here."""
    return _gamma(N_C - 1, 2.0 ** (1 - ACC_BITS)) + _gamma(K // N_C + 2, FP32_U)


def cuda_gap_bound(A, B):
    """The bound on the relative Frobenius gap of the kernel's X W^T to the emulation, from the
    dequantised operands A (M, K) and B (N, K): summing the per-output bounds in Frobenius norm,
    c * || |A| |B|^T ||_F / || A B^T ||_F."""
    A, B = A.double(), B.double()
    return cuda_coefficient(A.shape[1]) * ((A.abs() @ B.abs().t()).norm() / (A @ B.t()).norm()).item()


def _kernels(args):
    r = try_kernels()
    return r, "\n".join(f"{k}: " + (f"ran, gap to the emulation {v['gap']:.1e}" if v["ran"]
                                    else f"refused: {v['error']}")
                        for k, v in r["kernels"].items())


EXPERIMENTS = {"fp8-kernels": _kernels}

if __name__ == "__main__":
    from labs.launcher import cli
    from labs.precision import experiment
    cli.main(lambda: experiment.main(experiments=EXPERIMENTS))
