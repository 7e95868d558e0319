"""Chapter 14: drift or bug? The bound a correct layout's losses stay within, and broken layouts beyond it.

A correct layout runs one process's arithmetic with its sums in another order, so its loss at step
t differs from one process's by at most (first order in the unit roundoff u)

    B_t = F_t + sum_i |g_t,i| dw_t,i

- F_t, reduction order in the forward: `labs.planning.rounding` adds up 2 gamma_K <|dL/dy|, |A||B|>
  over the ops this layout reorders (`reordered`): the transformer blocks' matmuls under tp > 1;
  under cp > 1 also the head, the attention matmuls and softmax, and the mean of the cross
  entropy. dp and pp alone change no forward sum (each micro-batch runs the same ops).
- dw_t,i, how far weight i can have moved apart after t steps of Adam. The gradients differ by at
  most delta_s,i = 2 gamma_N |g|_abs (N tokens, |g|_abs the gradient with absolute terms). Adam's
  step m/(sqrt(v) + eps) passes that on to first order through its moments (`weight_drift`), except
  where delta is as large as the gradient itself: there the sign can flip, and the step can differ
  by as much as Adam's largest step, 2 lr B(s) (chapter 3, `labs.zero.adam_drift.adam_step_bound`).
The loss then moves by at most |g_t| . dw_t (first order; the notebook reports how far the nearest
gradient is from flipping, so the second-order term of a flip is known to be absent).

In bf16 (u = 2^-8) every term is 2^16 times larger: `bound(..., u=BF16)`.

A bug is a layout that computes something else. `VARIANTS` breaks each dimension once: Megatron's f
without its backward all-reduce, ZeRO-1 without the reduce-scatter (each replica steps on its own
gradient), the gradient summed over replicas and not averaged, the last stage reading the next
micro-batch's targets, and all-gather CP without the reduce-scatter of dK and dV.
"""
import torch

from labs.dims import ParallelDims
from labs.planning import layout3d, rounding, train3d
from labs.zero.adam_drift import adam_step_bound

FP32, BF16 = 2.0 ** -24, 2.0 ** -8
LAYOUT_3D, LAYOUT_4D = ParallelDims(dp=2, tp=2, pp=2), ParallelDims(cp=2, tp=2, pp=2)
VARIANTS = {   # name: (layout, bugs, what is wrong)
    "3d": (LAYOUT_3D, (), "correct: dp 2 x tp 2 x pp 2"),
    "tp_backward": (LAYOUT_3D, ("tp_backward",), "TP: f without its all-reduce in backward"),
    "dp_not_reduced": (LAYOUT_3D, ("dp_not_reduced",), "DP: ZeRO-1 without the reduce-scatter"),
    "dp_not_averaged": (LAYOUT_3D, ("dp_not_averaged",), "DP: gradients summed over replicas, not averaged"),
    "pp_targets": (LAYOUT_3D, ("pp_targets",), "PP: the last stage reads the next micro-batch's targets"),
    "4d": (LAYOUT_4D, (), "correct: cp 2 x tp 2 x pp 2"),
    "cp_backward": (LAYOUT_4D, ("cp_backward",), "CP: dK, dV kept local, not reduce-scattered"),
}


def reordered(dims):
    """The kinds of forward op whose sums this layout orders differently, and whether its gradients' are."""
    tp, cp, dp = dims.tp, dims.cp, dims.dp
    kinds = ({"block"} if tp > 1 else set()) | (set(rounding.KINDS) if cp > 1 else set())
    return kinds, dp > 1 or tp > 1 or cp > 1


def weight_drift(grads, deltas, lr, betas=(0.9, 0.999), eps=1e-8):
    """Per step, a bound on |w_layout - w_one_process| per weight, from the one process's gradients
    ``grads`` and the gradients' rounding bounds ``deltas`` (lists of {name: tensor}, one per step).

    To first order in delta: |dm| <= M = b1 M + (1 - b1) delta, |dv| <= D = b2 D + (1 - b2) 2|g| delta,
    and the step m^/(sqrt(v^) + eps) moves by at most M^/(sqrt(v^) + eps) + |m^| D^/(2 sqrt(v^)
    (sqrt(v^) + eps)^2) (hats: bias-corrected). Once |g| <= delta at some step the sign is free: from
    then on the step differs by up to 2 B(s). Returns, per step s, (dw after s steps, {name: how many of
    its weights' signs are free}).
    """
    b1, b2 = betas
    names = grads[0].keys()
    m, v, M, D, dw = ({n: torch.zeros_like(grads[0][n], dtype=torch.float64) for n in names} for _ in range(5))
    free = {n: torch.zeros_like(grads[0][n], dtype=torch.bool) for n in names}
    out = []
    for s, (g_s, d_s) in enumerate(zip(grads, deltas), start=1):
        cap = 2 * adam_step_bound(s, betas)
        for n in names:
            g, d = g_s[n].double(), d_s[n].double()
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            M[n] = b1 * M[n] + (1 - b1) * d
            D[n] = b2 * D[n] + (1 - b2) * 2 * g.abs() * d
            root = (v[n] / (1 - b2 ** s)).sqrt()
            moved = root > 0
            safe = torch.where(moved, root, torch.ones_like(root))
            step = (M[n] / (1 - b1 ** s)) / (safe + eps) + \
                (m[n] / (1 - b1 ** s)).abs() * (D[n] / (1 - b2 ** s)) / (2 * safe * (safe + eps) ** 2)
            free[n] |= (d > 0) & (g.abs() <= d)
            step = torch.where(free[n], torch.full_like(step, cap), step.clamp(max=cap))
            dw[n] = dw[n] + lr * torch.where(moved | free[n], step, torch.zeros_like(step))
        out.append(({n: t.clone() for n, t in dw.items()}, {n: int(f.sum()) for n, f in free.items()}))
    return out


def bound(dims, steps=layout3d.STEPS, lr=layout3d.LR, micro_batch=layout3d.MICRO_BATCH,
          num_microbatches=layout3d.MICROBATCHES, u=FP32):
    """One process's run, watched; the bound B_t of every step for this layout, with its terms.

    Returns losses (one process's), bound, forward (F_t), adam (the |g| . dw term), flippable (weights
    whose sign could flip by step t), free_by_param (how many per parameter, by the last step), margin
    (the smallest |g| / delta over weights with a nonzero delta: how far the nearest gradient is from
    flipping; inf when the layout reorders no gradient)."""
    cfg = layout3d.config()
    kinds, grads_reordered = reordered(dims)
    dp, m, b = dims.dp, num_microbatches, micro_batch
    ref = layout3d.reference(cfg, dp, m, b, steps, lr, watch=lambda net: rounding.Rounding(net, u))
    tokens = dp * m * b * cfg.seq_len
    scale = 2 * rounding.gamma(tokens, u) if grads_reordered else 0.0
    deltas = [{n: scale * a for n, a in w.absgrad.items()} for w in ref["watched"]]
    drift = weight_drift(ref["grads"], deltas, lr)
    forward = [sum(w.forward[k] for k in kinds) for w in ref["watched"]]
    adam = [0.0] + [sum((ref["grads"][t][n].double().abs() * drift[t - 1][0][n]).sum().item()
                        for n in drift[t - 1][0]) for t in range(1, steps)]
    ratios = [(g.abs() / d)[d > 0] for step_g, step_d in zip(ref["grads"], deltas)
              for g, d in ((step_g[n], step_d[n]) for n in step_g)]
    ratios = torch.cat([r.reshape(-1) for r in ratios]) if ratios else torch.empty(0)
    return {"losses": ref["losses"], "bound": [f + a for f, a in zip(forward, adam)], "forward": forward,
            "adam": adam, "flippable": [0] + [sum(d[1].values()) for d in drift[:steps - 1]], "kinds": sorted(kinds),
            "free_by_param": {n: c for n, c in drift[steps - 2][1].items() if c} if steps > 1 else {},
            "margin": ratios.min().item() if ratios.numel() else float("inf"), "u": u}


def table(names=tuple(VARIANTS), steps=layout3d.STEPS, lr=layout3d.LR, timeout=600):
    """Every variant's loss difference from one process, step by step, beside its layout's bound.

    One job per layout runs all of its variants. A row is "inside" when every step's difference is
    within the bound, else it names the first step beyond it."""
    rows, bounds = {}, {}
    for layout in (LAYOUT_3D, LAYOUT_4D):
        mine = [n for n in names if VARIANTS[n][0] == layout]
        if not mine:
            continue
        key = layout
        bounds[key] = bound(layout, steps, lr)
        runs = train3d.run(layout, [VARIANTS[n][1] for n in mine], steps, lr, timeout=timeout)
        for n, r in zip(mine, runs):
            b = bounds[key]
            diff = [abs(x - y) for x, y in zip(r["losses"], b["losses"])]
            beyond = [t + 1 for t, (d, lim) in enumerate(zip(diff, b["bound"])) if d > lim]
            rows[n] = {"layout": layout.degrees(), "what": VARIANTS[n][2], "bug": bool(VARIANTS[n][1]),
                       "diff": diff, "bound": b["bound"], "first_step_beyond": beyond[0] if beyond else None,
                       "losses": r["losses"], "sent": r["sent"]}
    return {"rows": rows, "bounds": {repr(k): v for k, v in bounds.items()}}
