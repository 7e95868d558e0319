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
with outlier channels (per-tensor and per-row through ``torch._scaled_mm``); `accumulation`
emulates the short accumulator; `allgather_bytes` sends FP8 as uint8 through gloo.
"""
import math

import torch
import torch.distributed as dist

from labs.measure import comm

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GRANULARITIES = ("tensor", "row", "1x128", "128x128")
BLOCK = 128


def activations(rows=256, cols=512, outliers=4, outlier_gain=100.0, seed=0):
    """Heavy-tailed activations (Student-t, 3 degrees of freedom) with ``outliers`` channels
    (columns) ``outlier_gain`` times larger than the rest: the shape of a transformer's
    activations that per-tensor scaling handles badly."""
    g = torch.Generator().manual_seed(seed)
    x = _student_t(rows, cols, g)  # (M, K)
    channels = torch.randperm(cols, generator=g)[:outliers]
    x[:, channels] *= outlier_gain
    return x


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


def _rel(y, ref):
    return ((y - ref).norm() / ref.norm()).item()


def scaled_mm(x, w, granularity):
    """Y = X W^T from FP8 operands through ``torch._scaled_mm`` (tensorwise or rowwise scales).

    _scaled_mm multiplies by *dequantisation* scales (1/scale), rowwise ones shaped (M, 1) and
    (1, N); its second operand must be column-major, hence w_q.t(). Returns (Y, how) where how
    says whether the kernel ran or, where this torch has no such CPU kernel, an emulation did.
    """
    xq, sx = quantize(x, granularity)
    wq, sw = quantize(w, granularity)  # (N, K): per-row of W is per output channel
    inv_x, inv_w = (1 / sx).float(), (1 / sw).float()
    if granularity == "row":
        inv_w = inv_w.reshape(1, -1)  # (1, N)
    else:
        inv_x, inv_w = inv_x.reshape(()), inv_w.reshape(())
    try:
        y = torch._scaled_mm(xq, wq.t(), scale_a=inv_x, scale_b=inv_w, out_dtype=torch.float32)
        return y, "torch._scaled_mm"
    except (RuntimeError, NotImplementedError):
        return dequantize(xq, sx) @ dequantize(wq, sw).t(), "emulated (no _scaled_mm CPU kernel)"


def matmul_error(M=256, K=512, N=256, outliers=4, outlier_gain=1000.0, seed=0, fmt="e4m3"):
    """Relative Frobenius error of X W^T from FP8 operands vs FP32, per granularity.

    Activations X get outlier channels; weights W are Gaussian. Block scaling is the DeepSeek-V3
    pairing: X per 1x128 tile, W per 128x128 block (emulated: dequantise, matmul in fp32).
    The outliers dominate ||Y||, so the damage to the ordinary channels is also reported as
    ``x_zero_fraction``: the share of X's entries flushed to zero by each scaling.
    Returns {"errors": {granularity: error}, "x_zero_fraction": {...}, "scaled_mm": how
    per-tensor/per-row ran, "scaled_mm_vs_emulated": max relative gap}.
    """
    x = activations(M, K, outliers, outlier_gain, seed=seed)  # (M, K)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed + 1)) / math.sqrt(K)  # (N, K)
    ref = x.double() @ w.double().t()
    errors, how, gap = {}, {}, 0.0
    for gran in ("tensor", "row"):
        y, how[gran] = scaled_mm(x, w, gran)
        emulated = dequantize(*quantize(x, gran, fmt)) @ dequantize(*quantize(w, gran, fmt)).t()
        gap = max(gap, _rel(y.double(), emulated.double()))
        errors[gran] = _rel(y.double(), ref)
    xq = dequantize(*quantize(x, "1x128", fmt))
    wq = dequantize(*quantize(w, "128x128", fmt))
    errors["block"] = _rel((xq.double() @ wq.double().t()), ref)
    zeros = {g: (quantize(x, g, fmt)[0].float() == 0).double().mean().item() for g in ("tensor", "row", "1x128")}
    zeros["block"] = zeros.pop("1x128")
    return {"errors": errors, "x_zero_fraction": zeros, "scaled_mm": how, "scaled_mm_vs_emulated": gap,
            "shape": [M, K, N], "outliers": outliers}


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


def _gloo_refuses_fp8(shard):
    """Whether the process group refuses an FP8 tensor (gloo has no FP8 type); the message if so."""
    out = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype)
    try:
        comm.all_gather_single(out, shard)
        return None
    except (RuntimeError, TypeError, ValueError) as exc:
        return str(exc).splitlines()[0][:120]


def allgather_worker(rank, world_size, numel=4096):
    """All-gather a BF16 shard, then the same shard as E4M3 bytes (viewed as uint8) plus its fp32
    scale; payload bytes counted by labs.measure.comm. The gathered FP8 is checked against quantising
    every rank's shard locally."""
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn(numel, generator=g).to(torch.bfloat16)  # (numel,)
    with comm.counting() as bf16_tally:
        full = torch.empty(world_size * numel, dtype=torch.bfloat16)
        comm.all_gather(full, shard)
    q, scale = quantize(shard.float().reshape(1, -1), "tensor")  # (1, numel) e4m3, (1, 1) fp32
    refused = _gloo_refuses_fp8(q.reshape(-1)) if dist.get_backend() == "gloo" else None
    with comm.counting() as fp8_tally:
        raw = torch.empty(world_size * numel, dtype=torch.uint8)
        comm.all_gather(raw, q.reshape(-1).view(torch.uint8))  # the FP8 bits, as bytes
        scales = torch.empty(world_size, dtype=torch.float32)
        comm.all_gather(scales, scale.reshape(1).float())
    gathered = raw.view(torch.float8_e4m3fn).float().reshape(world_size, numel) / scales.reshape(-1, 1)
    return {"bf16_payload": bf16_tally.ops["all_gather"]["payload_bytes"],
            "fp8_payload": fp8_tally.ops["all_gather"]["payloads"][0],
            "scale_payload": fp8_tally.ops["all_gather"]["payloads"][1],
            "bf16_formula_sent": bf16_tally.formula_bytes_sent, "fp8_formula_sent": fp8_tally.formula_bytes_sent,
            "gloo_refuses_fp8": refused, "gathered": gathered, "full_bf16": full}


def allgather_bytes(world_size=2, numel=4096, timeout=60.0):
    """Spawn ``world_size`` ranks of `allgather_worker`; check the gathered FP8 on rank 0 against
    every rank's shard quantised here. Returns the byte counts (payload and formula, labelled)."""
    from labs.launcher import launch
    results = launch.spawn(allgather_worker, world_size, numel, timeout=timeout)
    r0 = results[0]
    for rank in range(world_size):
        shard = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        local = dequantize(*quantize(shard.float().reshape(1, -1), "tensor")).reshape(-1)
        assert torch.equal(r0["gathered"][rank], local), f"rank {rank}'s FP8 bytes arrived changed"
        assert torch.equal(r0["full_bf16"][rank * numel:(rank + 1) * numel], shard)
    keys = ("bf16_payload", "fp8_payload", "scale_payload", "bf16_formula_sent", "fp8_formula_sent",
            "gloo_refuses_fp8")
    return {"world_size": world_size, "numel": numel, **{k: r0[k] for k in keys}}


def _fp8_scaling(args):
    r = matmul_error()
    return r, "\n".join(f"{g}: relative error {e:.4f}, X zeros {r['x_zero_fraction'][g]:.4f}"
                        for g, e in r["errors"].items())


def _accumulation(args):
    r = accumulation()
    return r, "\n".join(f"K={k}: limited {a:.2e}, promoted every {r['interval']} {b:.2e}"
                        for k, a, b in zip(r["K"], r["limited"], r["promoted"]))


def _allgather(args):
    r = allgather_bytes(args.world_size, timeout=args.timeout)
    return r, (f"all-gather payload per rank: bf16 {r['bf16_payload']} B, fp8 {r['fp8_payload']} B "
               f"+ scale {r['scale_payload']} B (counted); gloo on raw fp8: {r['gloo_refuses_fp8']}")


EXPERIMENTS = {"fp8-scaling": _fp8_scaling, "accumulation": _accumulation, "fp8-allgather": _allgather}

if __name__ == "__main__":
    from labs.launcher import cli
    from labs.precision import experiment
    cli.main(lambda: experiment.main(experiments=EXPERIMENTS))
