"""Where an FP8 scale comes from: MXFP8 beside 1x128 tiles, and delayed beside current scaling
(chapter 8).

- **Microscaling.** The OCP Microscaling (MX) specification v1.0 (2023; Rouhani et al. 2023,
  "Microscaling Data Formats for Deep Learning", arXiv 2310.10537, Algorithm 1) gives every block
  of 32 consecutive elements one shared scale X = 2^e stored as E8M0 (an 8-bit exponent, no
  mantissa, one byte), with e = floor(log2 amax) - emax_elem, emax_elem = 8 for E4M3 (448 =
  1.75 * 2^8); the elements V / X are cast to E4M3 and clamped to its largest normal. Because X is
  rounded *down* to a power of two, amax / X lies in [256, 512): the top of a block can exceed 448
  and saturate. `mx_quantize` implements that rule, and the "round up" variant (e = ceil(log2(amax
  / 448)), which never saturates) beside it. DeepSeek-V3 (section 3.3.2) uses 1x128 tiles with an
  fp32 scale per tile; `blocks_vs_mx` measures both on the same activations, with the bytes of
  scales per element read from the scale tensors.
- **Delayed scaling.** A per-tensor scale can come from the tensor itself (current, "just in time"
  scaling: read the amax, then cast, two passes) or from the amax of earlier steps (delayed scaling,
  Transformer Engine's ``DelayedScaling``: scale = fmax / max(amax_history) / 2^margin, one pass,
  values above the range clipped; DeepSeek-V3 section 3.3.2 calls it "delayed quantization" and
  computes its scales online instead). `drift` quantizes an activation whose amax grows every step
  and then spikes once, both ways, and counts per step what saturates, what flushes to zero and
  the error.
"""
import torch

from labs.precision import fp8

E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max   # 448
# Above 448 the next E4M3 step would be 480 if the exponent went on: rounding to nearest takes a
# scaled value up to the midpoint 464 (a tie, to the even 448) to 448 as it rounds any value; one
# above 464 has overflowed. What a cast then does is the conversion's choice (saturate to 448 or NaN,
# OCP OFP8 v1.0 section 5.2); the lab clamps to 448 before every cast, so "overflowed" below always
# means |scaled value| > 464: the clamp's count, a threshold derived from the format.
OVERFLOW = FMAX + 16
EMAX_ELEM = 8                  # exponent of E4M3's largest normal, 448 = 1.75 * 2^8
MX_BLOCK = 32


def _floor_log2(a):
    """floor(log2 a) exactly, from the binary exponent (no rounding in a log): a = m 2^e, 0.5 <= m < 1."""
    return torch.frexp(a)[1] - 1


def mx_quantize(x, rounding="floor"):
    """x (M, K) to MXFP8: E4M3 elements and one E8M0 scale per 1x32 block along K.

    ``rounding="floor"``: the specification's e = floor(log2 amax) - 8 (elements clamped to 448);
    ``"ceil"``: the smallest power of two with amax / 2^e <= 448. Returns (q (M, K) e4m3,
    scale (M, K/32) e8m0, saturated: how many elements were clamped).
    """
    M, K = x.shape
    if K % MX_BLOCK:
        raise ValueError(f"MX blocks need K divisible by {MX_BLOCK}; got K = {K}.")
    blocks = x.float().reshape(M, K // MX_BLOCK, MX_BLOCK)                 # (M, K/32, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True).clamp_min(2.0 ** -126)   # an all-zero block: any scale
    if rounding == "floor":
        e = _floor_log2(amax) - EMAX_ELEM
    elif rounding == "ceil":
        e = _floor_log2(amax / FMAX)
        e = e + (amax / FMAX > torch.exp2(e.float())).int()                  # round up unless exact
    else:
        raise ValueError(f"rounding must be 'floor' or 'ceil', got {rounding!r}.")
    e = e.clamp(-127, 127)                                                   # E8M0's range
    scaled = blocks / torch.exp2(e.float())                                  # exact: a power of two
    saturated = int((scaled.abs() > OVERFLOW).sum())   # the clamp's count
    q = scaled.clamp(-FMAX, FMAX).to(E4M3).reshape(M, K)
    scale = torch.exp2(e.float()).reshape(M, K // MX_BLOCK).to(torch.float8_e8m0fnu)
    return q, scale, saturated


def mx_dequantize(q, scale):
    M, K = q.shape
    return (q.float().reshape(M, K // MX_BLOCK, MX_BLOCK) * scale.float().unsqueeze(2)).reshape(M, K)


def tile_quantize(x, power_of_two=False):
    """DeepSeek-V3's 1x128 tiles: one fp32 scale per tile (optionally rounded down to a power of two,
    as V3 does for some activations, section 3.3.3). Returns (q, scale (M, K/128) fp32, saturated).
    A scale of 448 / amax (or a power of two below it) puts each tile's amax at or under 448, so
    nothing saturates by construction; the count is taken anyway, as for the MX blocks."""
    M, K = x.shape
    tiles = x.float().reshape(M, K // fp8.BLOCK, fp8.BLOCK)
    amax = tiles.abs().amax(dim=2, keepdim=True).clamp_min(2.0 ** -126)
    scale = FMAX / amax                                                     # encode: x * scale
    if power_of_two:
        scale = torch.exp2(_floor_log2(scale).float())
    scaled = tiles * scale
    q = scaled.clamp(-FMAX, FMAX).to(E4M3).reshape(M, K)
    return q, scale.reshape(M, K // fp8.BLOCK), int((scaled.abs() > OVERFLOW).sum())


def tile_dequantize(q, scale):
    M, K = q.shape
    return (q.float().reshape(M, K // fp8.BLOCK, fp8.BLOCK) / scale.unsqueeze(2)).reshape(M, K)


def blocks_vs_mx(M=256, K=512, outliers=4, outlier_gain=1000.0, seed=0):
    """Quantization error, saturated elements and bytes of scales per element for the 1x128 tiles
    (fp32 and power-of-two scales) and MXFP8 (1x32 E8M0, the specification's floor rule and the
    round-up rule), on `fp8.activations`. The error is the relative Frobenius error of the ordinary
    channels (the outlier channels, which dominate ||X||, are left out of it: what a coarse scale
    hurts is their neighbours); ``flushed`` counts non-zero entries that became zero."""
    x, chosen = fp8.activations(M, K, outliers, outlier_gain, seed=seed, channels=True)  # (M, K)
    ordinary = torch.ones(K, dtype=torch.bool)
    ordinary[chosen] = False
    runs = {"1x128, fp32 scale": lambda: tile_quantize(x),
            "1x128, power-of-two scale": lambda: tile_quantize(x, True),
            "1x32 MX, E8M0 (spec: floor)": lambda: mx_quantize(x, "floor"),
            "1x32 MX, E8M0 (round up)": lambda: mx_quantize(x, "ceil")}
    out = {}
    for name, run in runs.items():
        q, scale, saturated = run()
        deq = (mx_dequantize if "MX" in name else tile_dequantize)(q, scale)
        diff = (deq - x)[:, ordinary]
        out[name] = {"error": (diff.norm() / x[:, ordinary].norm()).item(), "saturated": saturated,
                     "flushed": int(((q.float() == 0) & (x != 0)).sum()),
                     "scale_bytes_per_element": scale.numel() * scale.element_size() / x.numel(),
                     "element_bytes": q.element_size()}
    return {"shape": [M, K], "outliers": outliers, "rows": out}


# ---- delayed versus current scaling -------------------------------------------------------------

def drifting_activation(steps=40, rows=64, cols=256, growth=1.1, spike_step=20, spike=50.0, seed=0):
    """One activation per step: fresh Gaussian values times growth^t (an amax that grows 10 % a
    step, as activations do while a model trains), and at ``spike_step`` one step ``spike`` times
    larger (an outlier batch)."""
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        x = torch.randn(rows, cols, generator=g) * growth ** t
        yield x * spike if t == spike_step else x


def _cast(x, scale):
    """Per-tensor cast with ``scale``: (dequantised x, overflowed count, flushed-to-zero count).

    Overflowed is the clamp's count, |x * scale| > 464 (`OVERFLOW`). Counting from the clamped
    cast's output instead (an FP8 value more than 16, half the top spacing, from its scaled value)
    gives the same number by construction, so either way it is the format's threshold applied to
    the scaled values, not a measurement of the cast."""
    scaled = x * scale
    q = scaled.clamp(-FMAX, FMAX).to(E4M3)
    saturated = int((scaled.abs() > OVERFLOW).sum())
    flushed = int(((q.float() == 0) & (x != 0)).sum())
    return q.float() / scale, saturated, flushed


def drift(history=16, margin=0, **activation):
    """Quantize `drifting_activation` per tensor with current scaling (fmax / amax of this step) and
    with delayed scaling (fmax / max of the last ``history`` amaxes / 2^margin; scale 1 before any
    history, as Transformer Engine starts). Per step: saturated, flushed to zero, relative error.

    The prediction beside the counts: rounding to nearest takes any scaled value up to 464 (the
    midpoint to 480, the step E4M3 lacks) to 448, so delayed scaling overflows exactly on the steps
    whose amax exceeds the window's largest by the factor 464 / 448 (3.6 %); a step that beats the
    window by less rounds without overflow. Both sides apply the same threshold (per element to the
    scaled values, per step to the amaxes), so their agreement checks the window's bookkeeping (which
    amaxes set each step's scale), not the format. After a spike the scale stays small for
    ``history`` steps, until the spike leaves the window.
    """
    steps = {"current": [], "delayed": []}
    amaxes = []
    for x in drifting_activation(**activation):
        amax = x.abs().amax().item()
        window = amaxes[-history:]
        delayed_scale = FMAX / max(window) / 2 ** margin if window else 1.0
        for name, scale in (("current", FMAX / amax), ("delayed", delayed_scale)):
            deq, saturated, flushed = _cast(x, scale)
            steps[name].append({"amax": amax, "scale": scale, "saturated": saturated, "flushed": flushed,
                                "error": ((deq - x).norm() / x.norm()).item()})
        amaxes.append(amax)
    # the threshold, derived from the format (not measured): amax > top * 464 / 448
    top = [max(amaxes[max(0, t - history):t]) * 2 ** margin if t else FMAX for t in range(len(amaxes))]
    predicted = [t for t, a in enumerate(amaxes) if a * FMAX / top[t] > OVERFLOW]
    above = [t for t, a in enumerate(amaxes) if a > top[t]]   # beats the window's largest at all
    return {"history": history, "margin": margin, "amax": amaxes, "steps": steps,
            "saturating_steps_predicted": predicted, "above_window_steps": above,
            "saturating_steps": [t for t, s in enumerate(steps["delayed"]) if s["saturated"]],
            "totals": {k: {"saturated": sum(s["saturated"] for s in v),
                           "flushed": sum(s["flushed"] for s in v)}
                       for k, v in steps.items()}}


def late_scale_flush(factor=50.0, M=256, K=512, outliers=4, outlier_gain=1000.0, seed=0):
    """How many entries of `fp8.activations` (outlier channels) a per-tensor scale ``factor`` times
    too small flushes to zero, beside the right scale (448 / amax): a late scale's cost on
    activations whose ordinary values already sit near the bottom of E4M3's range."""
    x = fp8.activations(M, K, outliers, outlier_gain, seed=seed)
    right = FMAX / x.abs().amax().item()
    return {"elements": x.numel(), "factor": factor,
            "flushed_right": _cast(x, right)[2], "flushed_late": _cast(x, right / factor)[2]}


def _mx(args):
    r = blocks_vs_mx()
    return r, "\n".join(f"{k}: error {v['error']:.4f}, saturated {v['saturated']}, "
                        f"{v['scale_bytes_per_element']:.4f} B of scale per element"
                        for k, v in r["rows"].items())


def _drift(args):
    r = drift()
    return r, (f"delayed scaling saturated on steps {r['saturating_steps']} "
               f"(predicted {r['saturating_steps_predicted']}); totals {r['totals']}")


EXPERIMENTS = {"mxfp8": _mx, "delayed-scaling": _drift}

if __name__ == "__main__":
    from labs.launcher import cli
    from labs.precision import experiment
    cli.main(lambda: experiment.main(experiments=EXPERIMENTS))
