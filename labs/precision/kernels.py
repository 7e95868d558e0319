"""Which FP8 matrix-product kernels this build of torch really has: each one tried (chapter 8).

``torch._scaled_mm`` (and, from torch 2.10, ``torch.nn.functional.scaled_mm`` with an explicit
``ScalingType`` per operand) multiplies two FP8 matrices with their *decoding* scales (1 / the
encoding scale of `labs.precision.fp8.quantize`) and accumulates in fp32. Four recipes:
- tensorwise: one scale per operand (Micikevicius et al. 2022);
- rowwise: one per row of X and one per output channel of W;
- blockwise: DeepSeek-V3's 1x128 tiles of X and 128x128 blocks of W (section 3.3.2);
- MXFP8: 1x32 blocks of both with E8M0 scales (OCP MX v1.0; `labs.precision.scaling.mx_quantize`).
`try_kernels` calls each one on the same operands and records what happened: the kernel ran (and
its product's gap to the emulation, dequantise and multiply in fp64, on the *same* FP8 operands),
or the exact error it raised. Nothing is claimed for a recipe whose kernel did not run.
"""
import math

import torch
import torch.nn.functional as F

from labs.precision import fp8, scaling

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")


def _operands(recipe, x, w):
    """FP8 X (M, K), W^T (K, N) column-major, the decoding scales in the layouts the kernels take
    (tensorwise (), rowwise (M, 1) and (1, N), blockwise (M, K/128) and (K/128, N/128), MX (M, K/32)
    and (N, K/32) in E8M0), the ScalingType names, and the emulated product in fp64."""
    if recipe == "mxfp8":
        xq, sx, _ = scaling.mx_quantize(x, "ceil")
        wq, sw, _ = scaling.mx_quantize(w, "ceil")
        ref = scaling.mx_dequantize(xq, sx).double() @ scaling.mx_dequantize(wq, sw).double().t()
        return xq, wq.t(), sx, sw, ("BlockWise1x32", "BlockWise1x32"), ref
    gx, gw = {"tensorwise": ("tensor", "tensor"), "rowwise": ("row", "row"), "blockwise": ("1x128", "128x128")}[recipe]
    (xq, ex), (wq, ew) = fp8.quantize(x, gx), fp8.quantize(w, gw)
    ref = fp8.dequantize(xq, ex).double() @ fp8.dequantize(wq, ew).double().t()
    M, K = x.shape
    N = w.shape[0]
    if recipe == "tensorwise":
        sx, sw, kinds = (1 / ex).reshape(()), (1 / ew).reshape(()), ("TensorWise", "TensorWise")
    elif recipe == "rowwise":
        sx, sw, kinds = 1 / ex, (1 / ew).reshape(1, N), ("RowWise", "RowWise")
    else:   # one scale per tile of X and per block of W, read off the expanded scales of quantize
        sx = (1 / ex).reshape(M, K // fp8.BLOCK, fp8.BLOCK)[:, :, 0]                    # (M, K/128)
        sw = (1 / ew).reshape(N // fp8.BLOCK, fp8.BLOCK, K // fp8.BLOCK, fp8.BLOCK)[:, 0, :, 0].t()  # (K/128, N/128)
        kinds = ("BlockWise1x128", "BlockWise128x128")
    return xq, wq.t(), sx.float(), sw.float(), kinds, ref


def _call(a, b, sa, sb, kinds):
    """F.scaled_mm with the recipe named where this torch has it, else the older torch._scaled_mm."""
    if hasattr(F, "scaled_mm"):
        return F.scaled_mm(a, b, sa, getattr(F.ScalingType, kinds[0]), sb, getattr(F.ScalingType, kinds[1]),
                           output_dtype=torch.float32)
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)


def try_kernels(M=256, K=512, N=256, seed=0, device="cpu"):
    """Call every recipe's kernel once on ``device``. Returns {recipe: {"ran": bool, "error": the
    exception's type and whole message or None, "gap": the kernel's relative gap to the emulation on
    the same FP8 operands, or None where it did not run}} and the torch version."""
    x = fp8.activations(M, K, seed=seed)                                                    # (M, K)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed + 1)) / math.sqrt(K)  # (N, K)
    out = {}
    for recipe in RECIPES:
        a, b, sa, sb, kinds, ref = _operands(recipe, x, w)
        try:
            y = _call(a.to(device), b.to(device), sa.to(device), sb.to(device), kinds).cpu()
        except Exception as exc:  # noqa: BLE001 -- any refusal is the finding, recorded word for word
            # whole: past its first line the message lists the configurations the kernel does take
            out[recipe] = {"ran": False, "error": f"{type(exc).__name__}: {str(exc).strip()}", "gap": None}
            continue
        gap = ((y.double() - ref).norm() / ref.norm()).item()
        out[recipe] = {"ran": True, "error": None, "gap": gap}
    return {"torch": torch.__version__, "device": device, "kernels": out}


# Both sides multiply the same FP8 values, whose products are exact in fp32; only the order of the
# fp32 additions differs: a few fp32 roundings over K = 512 terms, far below 1e-6 relative.
GAP_BOUND = 1e-6


def _kernels(args):
    r = try_kernels()
    return r, "\n".join(f"{k}: " + (f"ran, gap to the emulation {v['gap']:.1e}" if v["ran"] else f"refused: {v['error']}")
                        for k, v in r["kernels"].items())


EXPERIMENTS = {"fp8-kernels": _kernels}

if __name__ == "__main__":
    from labs.launcher import cli
    from labs.precision import experiment
    cli.main(lambda: experiment.main(experiments=EXPERIMENTS))
