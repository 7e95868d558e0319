"""FP16 underflow and dynamic loss scaling, measured (chapter 8).

Micikevicius et al. 2018 ("Mixed Precision Training", arXiv 1710.03740, section 3.2): gradients
too small for FP16 flush to zero; multiplying the loss by S shifts every gradient up by log2(S)
binades (the chain rule is linear), and dividing the fp32 gradients by S before the update undoes
it. A *dynamic* scaler picks S online: halve it and skip the step when a gradient is inf/NaN,
double it after ``growth_interval`` clean steps (the policy of ``torch.amp.GradScaler``).

`formats()` reads every bit layout from ``torch.finfo`` and checks it by casting; `underflow()`
counts gradients lost per format; `DynamicScaler` is the hand scaler, run beside GradScaler by
`scaler_trace()`; `track()` trains the tiny GPT in FP32, BF16, FP16 and FP16 with loss scaling.
"""
import math

import torch
import torch.nn.functional as F

from labs import model

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _survives(value, dtype):
    """Whether ``value`` comes back unchanged from a cast to ``dtype`` (not rounded, not inf/NaN)."""
    return torch.tensor(value, dtype=torch.float64).to(dtype).double().item() == value


def formats():
    """Each format's layout from torch.finfo: bits, exponent/mantissa bits, max, smallest normal,
    smallest subnormal (= smallest normal * eps) and eps (the gap after 1.0). Both ends are checked
    by casting: the smallest subnormal survives and half of it rounds to zero; the max survives and
    the next number of its spacing, max + 2^(floor(log2 max) - mantissa), does not, so a max or a
    mantissa width misread from finfo would fail here. What it becomes is recorded ("above_max"):
    inf where the format has one; E4M3 has none, and the OCP OFP8 specification (v1.0, section 5.2)
    lets a conversion either saturate to 448 or give NaN, so either is accepted and the one this
    build does is returned (with 10^4 times the max checked the same way)."""
    out = {}
    for name, dtype in DTYPES.items():
        fi = torch.finfo(dtype)
        mantissa = round(-math.log2(fi.eps))
        subnormal = fi.smallest_normal * fi.eps
        assert _survives(subnormal, dtype) and not _survives(subnormal / 2, dtype)
        top_step = 2.0 ** (math.floor(math.log2(fi.max)) - mantissa)
        assert _survives(fi.max, dtype) and not _survives(fi.max + top_step, dtype)
        over = torch.tensor([fi.max + top_step, 1e4 * fi.max], dtype=torch.float64).to(dtype).double()
        above = next((k for k, hit in (("inf", over.isinf()), ("max", over == fi.max), ("nan", over.isnan()))
                      if hit.all()), None)
        assert above == "inf" or (dtype == torch.float8_e4m3fn and above in ("max", "nan")), (name, over)
        out[name] = {"bits": fi.bits, "exponent_bits": fi.bits - 1 - mantissa, "mantissa_bits": mantissa,
                     "max": fi.max, "smallest_normal": fi.smallest_normal,
                     "smallest_subnormal": subnormal, "eps": fi.eps, "above_max": above}
    return out


def gradient_sample(n=100_000, center=-30.0, spread=6.0, seed=0):
    """Magnitudes 2^N(center, spread) with random signs: a stand-in for the activation-gradient
    histogram of Micikevicius et al. 2018 (Figure 3), most of whose mass lies below FP16's range."""
    g = torch.Generator().manual_seed(seed)
    exponent = center + spread * torch.randn(n, generator=g, dtype=torch.float64)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
    return sign * torch.exp2(exponent)  # (n,) float64


def underflow(scales=(1, 2 ** 8, 2 ** 16, 2 ** 24), seed=0):
    """Fraction of a gradient sample that becomes zero (and inf) when cast to each 16-bit format,
    after multiplying by each loss scale S."""
    grads = gradient_sample(seed=seed)
    rows = []
    for name in ("fp16", "bf16"):
        for s in scales:
            cast = (grads * s).to(DTYPES[name])
            rows.append({"format": name, "scale": s, "zero": (cast == 0).double().mean().item(),
                         "inf": cast.isinf().double().mean().item()})
    return {"n": grads.numel(), "rows": rows}


class DynamicScaler:
    """The hand dynamic loss scaler, GradScaler's interface and update rule (no per-device state).

    scale(loss) -> loss * S; step(opt): unscale grads (g / S), skip opt.step() if any is inf/NaN;
    update(): on overflow S *= backoff and the clean-step count restarts, else after
    ``growth_interval`` clean steps in a row S *= growth.
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.s, self.growth, self.backoff, self.interval = (init_scale, growth_factor, backoff_factor,
                                                            growth_interval)
        self.clean, self.found_inf = 0, False

    def get_scale(self):
        return self.s

    def scale(self, loss):
        return loss * self.s

    @torch.no_grad()
    def step(self, optimizer):
        grads = [p.grad for grp in optimizer.param_groups for p in grp["params"] if p.grad is not None]
        for g in grads:
            g.mul_(1.0 / self.s)  # GradScaler multiplies by the fp32 reciprocal too
        self.found_inf = any(not torch.isfinite(g).all() for g in grads)
        if not self.found_inf:
            optimizer.step()
        return None if self.found_inf else True

    def update(self):
        if self.found_inf:
            self.s *= self.backoff
            self.clean = 0
        else:
            self.clean += 1
            if self.clean == self.interval:
                self.s *= self.growth
                self.clean = 0


def _regression(seed=0, spike_step=None, spike=8.0):
    """A one-layer model run in FP16 under autocast; its targets make dL/dy about 2^-4, so the
    scaled gradient overflows FP16 (65,504) once S exceeds about 2^20. At ``spike_step`` the
    targets are ``spike`` times larger (an outlier batch): its gradients overflow a scale that the
    other batches pass, in the middle of a run of clean steps."""
    torch.manual_seed(seed)
    net = torch.nn.Linear(16, 16)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(32)]
    if spike_step is not None:
        x, y = batches[spike_step]
        batches[spike_step] = (x, y * spike)
    return net, batches


def _run_scaler(scaler, steps, init_seed=0, spike_step=None):
    net, batches = _regression(init_seed, spike_step)
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    trace = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(net(x), y)
        before = net.weight.detach().clone()
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        trace.append({"step": step, "scale": scale,
                      "skipped": bool(torch.equal(before, net.weight.detach()))})
    return trace, [p.detach().clone() for p in net.parameters()]


def scaler_trace(steps=14, init_scale=2.0 ** 22, growth_interval=3, spike_step=9):
    """Run the hand scaler and ``torch.amp.GradScaler("cpu")`` on the same FP16 model and batches.

    The outlier batch at ``spike_step`` overflows one clean step into a run of clean steps, so the
    trace shows the clean-step count restarting at an overflow (a scaler that kept counting would
    grow one step early there). Returns {"hand": [{step, scale, skipped}], "torch": [...],
    "params_equal": bool}; a step is skipped when the weights did not move.
    """
    kw = dict(init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=growth_interval)
    hand, hand_params = _run_scaler(DynamicScaler(**kw), steps, spike_step=spike_step)
    ref, ref_params = _run_scaler(torch.amp.GradScaler("cpu", **kw), steps, spike_step=spike_step)
    equal = all(torch.equal(a, b) for a, b in zip(hand_params, ref_params))
    return {"hand": hand, "torch": ref, "params_equal": equal, "spike_step": spike_step, **kw}


TRACK_MODES = ("fp32", "bf16", "fp16", "fp16_scaled")


def track(mode, steps=30, loss_weight=2.0 ** -24, lr=3e-3, seed=0, scale_eps=True, params=False):
    """Train the tiny GPT ``steps`` Adam steps in one precision; return its (unweighted) losses.

    The loss is multiplied by ``loss_weight``: a factor that pushes the tiny GPT's gradients below
    FP16's range (2^-24 and less), so that FP16 must lose them without a loss scale. Modes: fp32;
    bf16 and fp16 under autocast with fp32 weights; fp16_scaled adds `DynamicScaler`.

    Why FP32 does not see the weight: multiplying the loss by a power of two multiplies every
    gradient by it exactly (backpropagation is linear in the loss, and a power-of-two product is
    exact while nothing leaves the normal range), so Adam's m scales by w and sqrt(v) by w too.
    Adam's step m / (sqrt(v) + eps) is then unchanged only if eps is scaled by w as well, which
    ``scale_eps=True`` does (eps = 1e-8 * w). ``params=True`` also returns the final weights, so
    a run can be compared bit for bit with the unweighted one (`weight_invisible`).
    """
    if mode not in TRACK_MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(TRACK_MODES)}.")
    cfg = model.GPTConfig()
    net = model.build(cfg, seed=seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr, eps=1e-8 * (loss_weight if scale_eps else 1.0))
    scaler = DynamicScaler(init_scale=2.0 ** 32, growth_interval=10) if mode == "fp16_scaled" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp16_scaled": torch.float16}.get(mode)
    losses, zero_grads = [], []
    for step in range(steps):
        x, y = model.synthetic_batch(cfg, 8, seed=step % 4)  # four batches, revisited: the loss can fall
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = net(x, y)
        weighted = loss.float() * loss_weight
        (scaler.scale(weighted) if scaler else weighted).backward()
        grads = torch.cat([p.grad.flatten() for p in net.parameters()])
        zero_grads.append((grads == 0).double().mean().item())
        scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()
        losses.append(loss.item())
    out = {"mode": mode, "losses": losses, "zero_grad_fraction": zero_grads}
    if params:
        out["params"] = [p.detach().clone() for p in net.parameters()]
    return out


def weight_invisible(mode, steps=6, loss_weight=2.0 ** -24):
    """Whether training with the loss weighted by ``loss_weight`` (eps scaled with it) gives the
    unweighted run's weights bit for bit, and whether it still does with eps left at 1e-8.

    Exact comparisons are right here: the two runs execute the same operations in the same order
    on the same shapes; a power of two changes only exponents, unless a value leaves the format's
    normal range, which is what FP16 does and FP32 and BF16 do not."""
    plain = track(mode, steps, loss_weight=1.0, params=True)
    scaled = track(mode, steps, loss_weight, params=True)
    fixed = track(mode, steps, loss_weight, scale_eps=False, params=True)
    same = lambda run: all(torch.equal(a, b) for a, b in zip(plain["params"], run["params"]))  # noqa: E731
    return {"mode": mode, "loss_weight": loss_weight, "steps": steps,
            "equal_with_eps_scaled": same(scaled), "equal_with_eps_fixed": same(fixed),
            "final_loss": {"unweighted": plain["losses"][-1], "eps_scaled": scaled["losses"][-1],
                           "eps_fixed": fixed["losses"][-1]}}


def _underflow(args):
    r = underflow()
    lines = [f"{row['format']} x{row['scale']:>9,}: zero {row['zero']:.3f}, inf {row['inf']:.5f}"
             for row in r["rows"]]
    return {"formats": formats(), **r}, "\n".join(lines)


def _loss_scaling(args):
    r = scaler_trace(steps=args.steps)
    lines = [f"step {h['step']}: S = {h['scale']:.0f}{' skipped' if h['skipped'] else ''}" for h in r["hand"]]
    same = r["hand"] == r["torch"] and r["params_equal"]
    return r, "\n".join(lines + [f"hand scaler == GradScaler('cpu'): {same}"])


def _track(args):
    r = {m: track(m, steps=args.steps) for m in TRACK_MODES}
    return r, "\n".join(f"{m}: final loss {v['losses'][-1]:.4f}" for m, v in r.items())


EXPERIMENTS = {"underflow": _underflow, "loss-scaling": _loss_scaling, "track": _track}


# Chapter 8's exercises: the answers are computed here (from torch.finfo), so the book never types them.
def _e4m3_flush_below(amax):
    f = formats()["fp8_e4m3"]
    return f["smallest_subnormal"] / 2 * amax / f["max"]  # half the smallest step rounds to zero


EXERCISES = {
    # S lifting 2^-30 to FP16's smallest normal
    "1": lambda: formats()["fp16"]["smallest_normal"] / 2.0 ** -30,
    "2": lambda: _e4m3_flush_below(1792.0),
    # ring all-gather on 8 ranks: each rank sends 7 shards of 2^20 FP8 elements, each with its fp32 scale
    "3": lambda: 7 * (2 ** 20 * formats()["fp8_e4m3"]["bits"] // 8 + formats()["fp32"]["bits"] // 8),
    # the MX specification's shared exponent for a block whose amax is 1,000
    "4": lambda: _mx_exponent(1000.0, "floor"),
}


def _mx_exponent(amax, rounding):
    from labs.precision import scaling
    q, scale, _ = scaling.mx_quantize(torch.full((1, scaling.MX_BLOCK), amax), rounding)
    return math.log2(scale.float()[0, 0].item())


# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "1": [(lambda: 1.0 / 2.0 ** -30, "lifting 2^-30 to 1.0 instead of to FP16's smallest normal"),
          (lambda: formats()["fp16"]["smallest_subnormal"] / 2.0 ** -30,
           "lifting 2^-30 to FP16's smallest subnormal, not its smallest normal")],
    "2": [(lambda: 2 * _e4m3_flush_below(1792.0), "the whole smallest subnormal, not half of it")],
    "3": [(lambda: 7 * 2 ** 20 * formats()["fp8_e4m3"]["bits"] // 8,
           "the fp32 scales forgotten: one per shard"),
          (lambda: 8 * (2 ** 20 * formats()["fp8_e4m3"]["bits"] // 8 + formats()["fp32"]["bits"] // 8),
           "N shards sent instead of N - 1"),
          (lambda: 7 * 2 ** 20 * formats()["bf16"]["bits"] // 8, "the BF16 answer: two bytes per element")],
    "4": [(lambda: _mx_exponent(1000.0, "ceil"),
           "the exponent rounded up, which never saturates: not the rule"),
          (lambda: math.floor(math.log2(1000.0)),
           "log2 of the amax, without subtracting E4M3's top exponent 8")],
}


def check(question, answer, rel=0.01):
    from labs.measure import exercises
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES)


if __name__ == "__main__":
    from labs.launcher import cli
    from labs.precision import experiment
    cli.main(lambda: experiment.main(experiments=EXPERIMENTS))
