"""Speeds on a GPU: bf16 matmul TFLOP/s, one training step's MFU (chapter 1), FP8 ``_scaled_mm``
(chapter 8), the wall-clock cost of recomputation (chapter 9) and copy bandwidth (chapters 3, 11).

Every time is wall-clock around ``repeats`` calls after a warm-up, synchronized on the device
(CUDA events would time the same thing; a sync on both ends keeps one code path for the CPU dry
run). FLOPs are counted by FlopCounterMode (`labs.measure.flops.counting`), never assumed.
"""
import math

import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from labs.memory_budget import compute
from labs.measure import timing
from labs.measure.flops import counting as count_flops
from labs.precision import fp8, kernels
from labs.recompute import policies
from labs import model as tiny
from labs.gpu.figures import figure, refused, skipped
from labs.gpu.memory import gpt_200m

# NVIDIA H100 and H200 datasheets, dense BF16 tensor-core peak (SXM parts): 989.4 TFLOP/s
# (1,979 with 2:4 sparsity). Keyed by the whole name torch.cuda.get_device_name reports: the PCIe
# and NVL parts of both (e.g. "NVIDIA H200 NVL", "NVIDIA H100 PCIe") have lower peaks and names
# that contain these, so a part of a name never matches.
PEAKS = {"NVIDIA H100 80GB HBM3": compute.H100_BF16_DENSE, "NVIDIA H200": compute.H100_BF16_DENSE}


def seconds_per_call(fn, device, repeats, warmup=2):
    """Mean wall-clock seconds of fn() over ``repeats`` calls, after ``warmup`` calls (the clock
    read once the device's queued work is done: `labs.measure.timing.now`)."""
    for _ in range(warmup):
        fn()
    start = timing.now()
    for _ in range(repeats):
        fn()
    return (timing.now() - start) / repeats


def _tflops(m, k, n, device, repeats, dtype=torch.bfloat16):
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    t = seconds_per_call(lambda: a @ b, device, repeats)
    return figure(2 * m * k * n / t / 1e12, "TFLOP/s", computed_as="2*m*k*n / seconds",
                  shape=[m, k, n], seconds=t)


def _model_shapes(cfg, tokens):
    """(m, k, n) of each distinct linear in the model, m = the tokens of a step: qkv, proj, fc, proj, head."""
    h = cfg.hidden
    return {"qkv": (tokens, h, 3 * h), "attn_proj": (tokens, h, h), "fc": (tokens, h, 4 * h),
            "mlp_proj": (tokens, 4 * h, h), "head": (tokens, h, cfg.vocab_size)}


def matmul_tflops(device, sizes):
    """bf16 TFLOP/s at n^3 and at the linear shapes of the tiny model (labs.model.GPTConfig(), batch 2)
    and of the ~200M model (its batch), beside the peak of the device where one is known."""
    n = sizes.big_matmul
    out = {f"{n}^3": _tflops(n, n, n, device, sizes.matmul_repeats)}
    tiny_cfg, big_cfg = tiny.GPTConfig(), gpt_200m(sizes)
    for label, cfg, tokens in (("tiny", tiny_cfg, 2 * tiny_cfg.seq_len),
                               ("200M", big_cfg, sizes.model_batch * big_cfg.seq_len)):
        shapes = _model_shapes(cfg, tokens)
        out[label] = {k: _tflops(*shape, device, sizes.matmul_repeats) for k, shape in shapes.items()}
    out["peak"] = peak_figure(device)
    return out


def peak_of(name):
    """The datasheet dense bf16 peak (FLOP/s) of the device called exactly ``name``, or None."""
    return PEAKS.get(" ".join(name.split()))


def peak_figure(device):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_of(name)
    if peak is None:
        return skipped(f"no datasheet bf16 peak recorded for {name!r} (labs.gpu.speed.PEAKS)")
    return figure(peak / 1e12, "TFLOP/s", "formula", "datasheet dense bf16 peak", peak / 1e12)


def step_mfu(device, sizes):
    """One training step of the ~200M GPT (fp32 weights, bf16 autocast, fused AdamW where the build
    has it): FLOPs counted, seconds measured, MFU = FLOPs / seconds / peak (PaLM, arXiv 2204.02311, §4.1)."""
    cfg = gpt_200m(sizes)
    net = tiny.build(cfg, device=device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x, y = tiny.synthetic_batch(cfg, sizes.model_batch, seed=0, device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    with count_flops() as mode:
        step()
    flops = mode.get_total_flops()
    tokens = x.numel()                                   # from the batch actually run
    formula = tokens * compute.flops_per_token(compute.gpt_matmul_params(cfg), cfg.n_layer, cfg.hidden,
                                               x.size(1))["total"]
    t = seconds_per_call(step, device, sizes.step_repeats)
    out = {"flops": figure(flops, "FLOP", formula="tokens * (6*P_mm + 12*L*h*s)", formula_value=formula),
           "seconds": figure(t, "s"), "achieved": figure(flops / t / 1e12, "TFLOP/s"), "tokens": tokens}
    peak = peak_figure(device)
    out["mfu"] = peak if isinstance(peak, str) else figure(
        flops / t / (peak["value"] * 1e12), "fraction", computed_as="counted FLOPs / seconds / peak")
    return out


def _scaled(xq, wq, sa, sb):
    return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def _fp8_operands(x, w, granularity):
    """FP8 operands and the dequantisation scales _scaled_mm takes; blockwise: X per 1x128 tile
    and W per 128x128 block, in the layout CUDA checks (`labs.precision.kernels.blockwise_scales`)."""
    if granularity in ("tensor", "row"):
        (xq, sx), (wq, sw) = fp8.quantize(x, granularity), fp8.quantize(w, granularity)
        sa, sb = (1 / sx).float(), (1 / sw).float()
        sa, sb = (sa, sb.reshape(1, -1)) if granularity == "row" else (sa.reshape(()), sb.reshape(()))
        return xq, wq, [(sa, sb)]
    (xq, sx), (wq, sw) = fp8.quantize(x, "1x128"), fp8.quantize(w, "128x128")
    return xq, wq, [kernels.blockwise_scales(sx, sw)]


def _fp8_one(x, w, granularity, device, repeats):
    """Relative error vs the fp32 matmul and TFLOP/s, or the refusal; a layout that runs but
    disagrees with the emulation (dequantise, fp32 matmul) is refused too, never reported."""
    xq, wq, candidates = _fp8_operands(x, w, granularity)
    ref = x.float() @ w.float().t()
    emulated = fp8.dequantize(*fp8.quantize(x, "1x128" if granularity == "block" else granularity)) @ \
        fp8.dequantize(*fp8.quantize(w, "128x128" if granularity == "block" else granularity)).t()
    reasons = []
    for sa, sb in candidates:
        try:
            y = _scaled(xq, wq, sa, sb).float()
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            reasons.append(str(exc).split("\n")[0])
            continue
        gap = fp8.rel_error(y.double(), emulated.double())
        if gap > 2e-2:        # bf16 output rounding is ~4e-3; a wrong scale layout is off by far more
            reasons.append(f"ran with scales {tuple(sa.shape)}/{tuple(sb.shape)} "
                           f"but differs from the emulation by {gap:.3g}")
            continue
        t = seconds_per_call(lambda: _scaled(xq, wq, sa, sb), device, repeats)
        M, K = x.shape
        return {"rel_error_vs_fp32": figure(fp8.rel_error(y.double(), ref.double()), "relative Frobenius"),
                "vs_emulation": gap, "seconds": t, "tflops_at_error_shape": 2 * M * K * w.size(0) / t / 1e12}
    return refused("; ".join(dict.fromkeys(reasons)))


def fp8_matmul(device, sizes):
    """E4M3 ``torch._scaled_mm`` per scaling granularity: relative error against fp32 on activations
    with outlier channels (`labs.precision.fp8.activations`), and TFLOP/s at n^3 beside bf16 at n^3."""
    M, K, N = sizes.fp8_error_shape
    x = fp8.activations(M, K, outliers=4, outlier_gain=1000.0).to(device)                # (M, K)
    w = (torch.randn(N, K, generator=torch.Generator().manual_seed(1)) / math.sqrt(K)).to(device)  # (N, K)
    n = sizes.big_matmul
    big_x, big_w = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    out = {"shape_error": [M, K, N], "bf16": _tflops(n, n, n, device, sizes.matmul_repeats)}
    bf16_err = fp8.rel_error((x.bfloat16() @ w.bfloat16().t()).double(), (x.float() @ w.float().t()).double())
    out["bf16"]["rel_error_vs_fp32"] = figure(bf16_err, "relative Frobenius")
    for g in ("tensor", "row", "block"):
        got = _fp8_one(x, w, g, device, sizes.matmul_repeats)
        if not isinstance(got, str):
            speed = _fp8_one(big_x, big_w, g, device, sizes.matmul_repeats)
            got[f"tflops_{n}^3"] = speed if isinstance(speed, str) else figure(
                speed["tflops_at_error_shape"], "TFLOP/s", computed_as="2*n^3 / seconds",
                vs_bf16=speed["tflops_at_error_shape"] / out["bf16"]["value"])
        out[g] = got
    return out


def recompute_overhead(device, sizes):
    """Wall-clock of forward + backward per policy (`labs.recompute.policies.apply_policy`, bf16, early stop
    off as in Megatron), its ratio to "none", beside the counted and derived FLOP ratios."""
    layers, hidden, heads, seq, batch = sizes.recompute
    cfg = policies.config(layers, hidden, heads, seq)
    torch.manual_seed(0)
    blocks = [tiny.Block(cfg).to(device=device, dtype=torch.bfloat16) for _ in range(layers)]
    x = torch.randn(batch, seq, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)  # (B, T, H)
    out = {}
    with set_checkpoint_early_stop(False):
        for policy in policies.POLICIES:
            run = policies.apply_policy(blocks, policy, k=2)
            with count_flops() as mode:
                run(x).float().sum().backward()
            t = seconds_per_call(lambda: run(x).float().sum().backward(), device, sizes.recompute_repeats)
            f = policies.formula_flops(policy, cfg, batch * seq, seq)
            out[policy] = {"seconds": t, "flops": mode.get_total_flops(),
                           "formula_flops": f["forward"] + f["backward"]}
    base = out["none"]
    for r in out.values():
        r["time_ratio"] = figure(r["seconds"] / base["seconds"], "ratio", formula="FLOPs / FLOPs(none)",
                                 formula_value=r["formula_flops"] / base["formula_flops"],
                                 counted_flops_ratio=r["flops"] / base["flops"])
    out["config"] = {"layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "batch": batch}
    return out


def _bandwidth(src, dst, device, repeats):
    t = seconds_per_call(lambda: dst.copy_(src, non_blocking=False), device, repeats)
    return figure(src.numel() * src.element_size() / t / 1e9, "GB/s", bytes=src.numel() * src.element_size(),
                  seconds=t, note="bytes moved one way / seconds")


def copy_bandwidth(device, sizes):
    """Device-to-device copy; pinned and pageable host <-> device (what chapter 3's ZeRO-Offload
    figures assume of PCIe, labs.memory_budget.budget.LINKS)."""
    n = sizes.copy_bytes
    src, dst = (torch.empty(n, dtype=torch.uint8, device=device),
                torch.empty(n, dtype=torch.uint8, device=device))
    out = {"device_to_device": _bandwidth(src, dst, device, sizes.copy_repeats)}
    del src, dst
    if device.type != "cuda":
        reason = skipped("pinned and pageable host<->device copies need a CUDA device")
        return {**out, "note": "on a CPU device_to_device is a host memcpy", "h2d_pinned": reason,
                "d2h_pinned": reason, "h2d_pageable": reason, "d2h_pageable": reason}
    dev = torch.empty(sizes.host_bytes, dtype=torch.uint8, device=device)
    for kind, pin in (("pinned", True), ("pageable", False)):
        host = torch.empty(sizes.host_bytes, dtype=torch.uint8, pin_memory=pin)
        out[f"h2d_{kind}"] = _bandwidth(host, dev, device, sizes.copy_repeats)
        out[f"d2h_{kind}"] = _bandwidth(dev, host, device, sizes.copy_repeats)
    return out
