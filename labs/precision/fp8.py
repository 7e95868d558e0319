"""FP8 quantisation: scaling granularity, limited-precision accumulation, FP8 bytes on the wire
(chapter 8).

Micikevicius et al. 2022 ("FP8 Formats for Deep Learning", arXiv 2209.05433): E4M3 (max 448) and
E5M2 (max 57,344); a tensor is multiplied by a scale so its amax lands near the format's max,
cast, and divided by the scale after the matmul. DeepSeek-AI 2024 (DeepSeek-V3 Technical Report,
arXiv 2412.19437, section 3.3.2) scales activations per 1x128 tile (one token, 128 channels) and
weights per 128x128 block, so one outlier channel only coarsens its own tile; and because the
tensor cores keep about 14 bits of the running sum, it promotes the partial sum to an FP32
register every N_C = 128 elements of K.

`quantize` does all four granularities; `matmul_error` compares them on heavy-tailed activations
with outlier channels, and `matmul_error_seeds` repeats that over several draws; `accumulation`
emulates the short accumulator. The kernels themselves
(``torch._scaled_mm``) are tried in `labs.precision.kernels`; FP8 on gloo's wire is
`labs.precision.fp8_wire`; MXFP8 and delayed scaling are `labs.precision.scaling`.
"""
import math

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GRANULARITIES = ("tensor", "row", "1x128", "128x128")
BLOCK = 128


def activations(rows=256, cols=512, outliers=4, outlier_gain=100.0, seed=0, channels=False):
    """Heavy-tailed activations (Student-t, 3 degrees of freedom) with ``outliers`` channels
    (columns) ``outlier_gain`` times larger than the rest: the shape of a transformer's
    activations that per-tensor scaling handles badly. ``channels=True`` also returns the outlier
    columns."""
    g = torch.Generator().manual_seed(seed)
    x = _student_t(rows, cols, g)  # (M, K)
    chosen = torch.randperm(cols, generator=g)[:outliers]
    x[:, chosen] *= outlier_gain
    return (x, chosen) if channels else x


def _student_t(rows, cols, g, df=3):
    """t = z / sqrt(chi2_df / df), drawn from the seeded generator (torch.distributions has none)."""
    z = torch.randn(rows, cols, generator=g)
    chi2 = torch.randn(df, rows, cols, generator=g).pow(2).sum(0)
    return z / (chi2 / df).sqrt()


def _amax(x, granularity):
    """The absolute maximum per scaling group, broadcastable against x (M, K)."""
    M, K = x.shape
    a = x.abs()
    if granularity == "tensor":
        return a.amax().reshape(1, 1)
    if granularity == "row":
        return a.amax(dim=1, keepdim=True)  # (M, 1)
    if K % BLOCK or (granularity == "128x128" and M % BLOCK):
        raise ValueError(f"{granularity} blocks need dimensions divisible by {BLOCK}; got {M}x{K}.")
    if granularity == "1x128":
        tiles = a.reshape(M, K // BLOCK, BLOCK).amax(dim=2, keepdim=True)  # (M, K/128, 1)
        return tiles.expand(M, K // BLOCK, BLOCK).reshape(M, K)
    blocks = a.reshape(M // BLOCK, BLOCK, K // BLOCK, BLOCK).amax(dim=(1, 3), keepdim=True)
    return blocks.expand(M // BLOCK, BLOCK, K // BLOCK, BLOCK).reshape(M, K)


def quantize(x, granularity="tensor", fmt="e4m3"):
    """Cast x (M, K) to FP8 with one scale per group: returns (q, scale) with x ~ q.float() / scale.

    scale = fmax / amax (Micikevicius et al. 2022, section 4.3: map the amax onto the format's
    max); a group of zeros gets scale 1.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose one of {', '.join(GRANULARITIES)}.")
    dtype = FORMATS[fmt]
    amax = _amax(x.float(), granularity)
    scale = torch.where(amax > 0, torch.finfo(dtype).max / amax, torch.ones_like(amax))
    q = (x.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    return q, scale


def dequantize(q, scale):
    return q.float() / scale


def rel_error(y, ref):
    """Relative Frobenius error of ``y`` against ``ref``: ||y - ref|| / ||ref||."""
    return ((y - ref).norm() / ref.norm()).item()


def matmul_error(M=256, K=512, N=256, outliers=4, outlier_gain=1000.0, seed=0, fmt="e4m3"):
    """Relative Frobenius error of X W^T from FP8 operands vs the exact product, per granularity.

    Activations X get outlier channels; weights W are Gaussian. Per tensor: one scale each for X and
    W; per row: one per row of X and per row of W (an output channel); block: the DeepSeek-V3
    pairing, X per 1x128 tile and W per 128x128 block. Each product is the FP8 operands dequantised
    and multiplied in fp32, the same on every build (`labs.precision.kernels` runs the kernels).
    The outliers dominate ||Y||, so the damage to the ordinary channels is also reported as
    ``x_zero_fraction``: the share of X's entries flushed to zero by each scaling.
    """
    x = activations(M, K, outliers, outlier_gain, seed=seed)  # (M, K)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed + 1)) / math.sqrt(K)  # (N, K)
    ref = x.double() @ w.double().t()
    pairs = {"tensor": ("tensor", "tensor"), "row": ("row", "row"), "block": ("1x128", "128x128")}
    errors, zeros = {}, {}
    for name, (gx, gw) in pairs.items():
        xq = quantize(x, gx, fmt)
        y = dequantize(*xq) @ dequantize(*quantize(w, gw, fmt)).t()
        errors[name] = rel_error(y.double(), ref)
        zeros[name] = (xq[0].float() == 0).double().mean().item()
    return {"errors": errors, "x_zero_fraction": zeros, "shape": [M, K, N], "outliers": outliers}


def matmul_error_seeds(seeds=range(8), **kw):
    """`matmul_error` over several draws of X and W (``seeds``): per scaling, each draw's error and
    flushed share, with their median, smallest and largest. One draw is one sample of the heavy
    tail; the spread over draws is what a reader needs beside it."""
    import statistics

    runs = [matmul_error(seed=s, **kw) for s in seeds]
    out = {"seeds": list(seeds), "runs": runs}
    for key in ("errors", "x_zero_fraction"):
        per = {g: [r[key][g] for r in runs] for g in runs[0][key]}
        out[key] = {g: {"each": v, "median": statistics.median(v), "min": min(v), "max": max(v)}
                    for g, v in per.items()}
    return out


def round_to_bits(s, bits):
    """Round s (float64) to ``bits`` significant bits, nearest-even: a short accumulator."""
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, 0.5 <= |mant| < 1
    return torch.ldexp(torch.round(torch.ldexp(mant, torch.full_like(exp, bits))), exp - bits)


def dot_limited(a, b, bits=14, interval=None):
    """Row-wise dot products of a, b (R, K) summed left to right in a ``bits``-bit accumulator;
    with ``interval``, every ``interval`` elements the partial sum is added into an fp32 total and
    the short accumulator restarts (DeepSeek-V3 section 3.3.2's promotion, N_C = 128)."""
    prods = (a.double() * b.double())  # (R, K): FP8 x FP8 products are exact in fp64
    total = torch.zeros(a.shape[0], dtype=torch.float64)
    acc = torch.zeros_like(total)
    for k in range(a.shape[1]):
        acc = round_to_bits(acc + prods[:, k], bits)
        if interval and (k + 1) % interval == 0:
            total = (total + acc).float().double()  # the fp32 register
            acc = torch.zeros_like(acc)
    return (total + acc).float().double()


def accumulation(Ks=(128, 256, 512, 1024, 2048, 4096), rows=64, bits=14, interval=BLOCK, seed=0):
    """Mean relative error of FP8 dot products vs exact, against K, for a ``bits``-bit accumulator
    with and without promotion every ``interval`` elements. Operands are positive (|activations|
    after a ReLU-like layer), so the running sum grows with K and so does its rounding error."""
    g = torch.Generator().manual_seed(seed)
    out = {"K": list(Ks), "bits": bits, "interval": interval, "limited": [], "promoted": []}
    for K in Ks:
        a = quantize(torch.randn(rows, K, generator=g).abs(), "row")
        b = quantize(torch.randn(rows, K, generator=g).abs(), "row")
        a, b = dequantize(*a), dequantize(*b)  # FP8 values (exactly representable)
        exact = (a.double() * b.double()).sum(1)
        for key, iv in (("limited", None), ("promoted", interval)):
            got = dot_limited(a, b, bits, iv)
            out[key].append(((got - exact).abs() / exact).mean().item())
    return out


def _fp8_scaling(args):
    r = matmul_error()
    return r, "\n".join(f"{g}: relative error {e:.4f}, X zeros {r['x_zero_fraction'][g]:.4f}"
                        for g, e in r["errors"].items())


def _accumulation(args):
    r = accumulation()
    return r, "\n".join(f"K={k}: limited {a:.2e}, promoted every {r['interval']} {b:.2e}"
                        for k, a, b in zip(r["K"], r["limited"], r["promoted"]))


EXPERIMENTS = {"fp8-scaling": _fp8_scaling, "accumulation": _accumulation}

if __name__ == "__main__":
    from labs.launcher import cli
    from labs.precision import experiment
    cli.main(lambda: experiment.main(experiments=EXPERIMENTS))
