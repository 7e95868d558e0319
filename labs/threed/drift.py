"""Chapter 17: drift or bug? The bound a correct layout's losses stay within, and broken layouts beyond it.

A correct layout runs one process's arithmetic with its sums in another order, so its loss at step
t differs from one process's by about (first order in the unit roundoff u)

    B_t = F_t + sum_i |g_t,i| dw_t,i

- F_t, reduction order in the forward: `labs.threed.rounding` adds up 2 gamma_K <|dL/dy|, |A||B|>
  over the ops this layout reorders (`reordered`): the transformer blocks' matmuls under tp > 1;
  under cp > 1 also the head, the attention matmuls and softmax, and the mean of the cross
  entropy. dp and pp alone change no forward sum (each micro-batch runs the same ops).
- dw_t,i, how far weight i can have moved apart after t steps of Adam. Each weight's gradient is
  a sum over the N tokens of the step, and two orders of that sum differ by at most
  delta_s,i = 2 gamma_N |g|_abs (|g|_abs the gradient with absolute terms). Adam's step
  m/(sqrt(v) + eps) passes that on to first order through its moments (`weight_drift`; with
  coupled weight decay lambda the gradient Adam sees also carries lambda dw), except where delta is
  as large as the gradient itself: there the sign can flip, and the step can differ by as much as
  Adam's largest step, 2 lr U(s) (chapter 3, `labs.zero.adam_drift.adam_step_bound`).
The loss then moves by about |g_t| . dw_t.

It is a first-order estimate of two reorderings, not a proof that covers every one. It omits:
  - TP's all-reduce of the input gradient in backward (f, Shoeybi et al. 2019, section 3), whose
    reordered sum feeds every earlier layer's weight gradient;
  - CP's reduce-scatter of dK and dV, a sum over the cp ranks' queries in another order;
  - the forward's rounding differences feeding the backward: activations that differ by rounding
    give gradients that differ, beyond the reordered sum over tokens, and the weights' own
    difference feeding the next step's gradients;
  - the CP layout's blockwise softmax (log-sum-exp, rescaling and merge, chapter 6, and their
    backward): other operations than one process's softmax, charged as its sum in another order;
  - every term of second order in u (products of the differences above).
The notebook shows how far inside it the correct layouts stay (below 1 % of it, every step).

In bf16 training the matmuls accumulate in fp32 (tensor cores; PyTorch's CPU bf16 GEMM), so their
reordered sums keep fp32's u; the sums that really run in bf16 (u = 2^-8) are bf16 collectives,
which add one term per rank: `bound(..., u_collective=BF16)` adds, to first order,
2 gamma_(n-1)(bf16) per all-reduce of n partial sums, a plain sum of n terms (Higham section 4.2):
the gradients' over the n = dp cp ranks, TP's g over tp on the row-parallel outputs. An inner
product of 256 bf16 terms has no useful worst-case bound: gamma_n is undefined (n u >= 1), and the
bound that always holds, (1 + u)^n - 1 (Higham 3.1), is about 1.7 there.

A bug is a layout that computes something else. `VARIANTS` breaks each dimension once: Megatron's f
without its backward all-reduce, ZeRO-1 without the reduce-scatter (each rank updates its shard from
its own replica's gradient), the gradient summed over replicas and not averaged, replicated LayerNorm
gradients summed over tp and not averaged, the last stage reading the next micro-batch's targets, and
all-gather CP without the reduce-scatter of dK and dV. Adam's step does not change, element by
element, when a whole tensor's gradient is multiplied by a constant (up to eps), so any such bug
(`SCALE_BUGS`) stays inside the bound under plain Adam; the step-1 gradient check
(`labs.threed.gradcheck`, in every `table` row) refuses them. Under Adam with coupled weight decay the
gradient Adam sees is g + lambda w, whose direction the factor dp changes: the summed gradient leaves
the bound.
"""
import torch

from labs.dims import ParallelDims
from labs.threed import gradcheck, layout3d, rounding, train3d
from labs.zero.adam_drift import adam_step_bound

FP32, BF16 = 2.0 ** -24, 2.0 ** -8
# Two layouts of 8 ranks: dp x tp x pp, and dp x cp x tp, whose ZeRO-1 group is the dp x cp = 4
# ranks that hold the same weights. Together they use all four dimensions; neither is 4D (16 ranks).
LAYOUT_3D, LAYOUT_CP = ParallelDims(dp=2, tp=2, pp=2), ParallelDims(dp=2, cp=2, tp=2)
# The runs (model and batches of seed k, `layout3d.SEED_STRIDE`) the tests check the planted bugs on;
# the notebook runs seed 0. In the sweep of seeds 0..23 (`labs.threed.seeds`, results/threed/seeds.json)
# seed 22 holds the smallest ratio at a bug's first step beyond: tp_backward, about 1.04, at step 3. It is
# not the only thin case (seed 16's tp_backward about 1.15, seed 20's cp_backward about 1.19, seed 0's
# dp_not_reduced about 1.27), and the thinnest has fallen as seeds were added: a bug that stays inside
# for three steps on some seed is not ruled out.
SEEDS = (0, 22)
BUGS = ("tp_backward", "dp_not_reduced", "dp_not_averaged", "pp_targets", "cp_backward", "ln_summed")
# Bugs that scale a whole tensor's gradient by a constant: plain Adam's step does not see them, the
# loss stays inside the bound; the step-1 gradient check (`labs.threed.gradcheck`) refuses them.
SCALE_BUGS = ("dp_not_averaged", "ln_summed")
DECAY = "weight_decay"   # a setting, not a bug: Adam with coupled weight decay layout3d.WEIGHT_DECAY
VARIANTS = {   # name: (layout, changes: bugs and settings, what is wrong)
    "3d": (LAYOUT_3D, (), "correct: dp 2 x tp 2 x pp 2"),
    "tp_backward": (LAYOUT_3D, ("tp_backward",), "TP: f without its all-reduce in backward"),
    "dp_not_reduced": (LAYOUT_3D, ("dp_not_reduced",), "DP: ZeRO-1 without the reduce-scatter"),
    "dp_not_averaged": (LAYOUT_3D, ("dp_not_averaged",), "DP: gradients summed over replicas, not averaged"),
    "ln_summed": (LAYOUT_3D, ("ln_summed",), "TP: replicated LayerNorm gradients summed, not averaged"),
    "pp_targets": (LAYOUT_3D, ("pp_targets",), "PP: the last stage reads the next micro-batch's targets"),
    "3d_decay": (LAYOUT_3D, (DECAY,), "correct, Adam with coupled weight decay"),
    "dp_not_averaged_decay": (LAYOUT_3D, ("dp_not_averaged", DECAY), "DP summed, not averaged; weight decay"),
    "cp": (LAYOUT_CP, (), "correct: dp 2 x cp 2 x tp 2"),
    "cp_backward": (LAYOUT_CP, ("cp_backward",), "CP: dK, dV kept local, not reduce-scattered"),
}


# A bug the byte check catches, not the drift figure: ZeRO-1 over a group of the right size, the
# wrong ranks (dp x tp, which hold other weights); it sends the predicted number of bytes.
MISPLACED = {"zero_wrong_group": (LAYOUT_CP, ("zero_wrong_group",), "DP: ZeRO-1 over dp x tp, not dp x cp")}


def is_bug(name):
    """Whether variant ``name`` breaks the layout (else it is a correct run, in some setting)."""
    return name in MISPLACED or any(c in BUGS for c in VARIANTS[name][1])


def bound_key(name):
    """The bound variant ``name`` is held to: its layout's, with weight decay or without."""
    layout, changes, _ = {**VARIANTS, **MISPLACED}[name]
    return layout, DECAY in changes


def reordered(dims):
    """The kinds of forward op whose sums this layout orders differently, and whether its gradients' are."""
    tp, cp, dp = dims.tp, dims.cp, dims.dp
    kinds = ({"block"} if tp > 1 else set()) | (set(rounding.KINDS) if cp > 1 else set())
    return kinds, dp > 1 or tp > 1 or cp > 1


def weight_drift(grads, deltas, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, masks=False):
    """Per step, a bound on |w_layout - w_one_process| per weight, from the one process's gradients
    ``grads`` (as Adam sees them: with coupled weight decay, g + weight_decay * w) and the gradients'
    rounding bounds ``deltas`` (lists of {name: tensor}, one per step).

    With weight decay the gradient Adam sees differs by delta + weight_decay * dw (dw: the weights'
    difference before the step). To first order in it, d:
    |dm| <= M = b1 M + (1 - b1) d, |dv| <= D = b2 D + (1 - b2) 2|g| d,
    and the step m^/(sqrt(v^) + eps) moves by at most M^/(sqrt(v^) + eps) + |m^| D^/(2 sqrt(v^)
    (sqrt(v^) + eps)^2) (hats: bias-corrected). Once |g| <= delta at some step the sign is free: from
    then on the step differs by up to 2 U(s). Returns, per step s, (dw after s steps, {name: how many of
    its weights' signs are free}; with ``masks``, {name: which of them, a bool tensor}).
    """
    b1, b2 = betas
    names = grads[0].keys()
    m, v, M, D, dw = ({n: torch.zeros_like(grads[0][n], dtype=torch.float64) for n in names}
                      for _ in range(5))
    free = {n: torch.zeros_like(grads[0][n], dtype=torch.bool) for n in names}
    out = []
    for s, (g_s, d_s) in enumerate(zip(grads, deltas), start=1):
        cap = 2 * adam_step_bound(s, betas)
        for n in names:
            g, d = g_s[n].double(), d_s[n].double() + weight_decay * dw[n]
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
        out.append(({n: t.clone() for n, t in dw.items()},
                    {n: f.clone() if masks else int(f.sum()) for n, f in free.items()}))
    return out


def bound(dims, steps=layout3d.STEPS, lr=layout3d.LR, micro_batch=layout3d.MICRO_BATCH,
          num_microbatches=layout3d.MICROBATCHES, u=FP32, weight_decay=0.0, seed=0, u_collective=None):
    """One process's run (of seed ``seed``), watched; the bound B_t of every step for this layout.
    ``u``: the unit roundoff of the reordered sums' accumulation; ``u_collective``: that of the
    collectives' sums, when they run in a lower precision (bf16 all-reduces).

    Returns losses (one process's), bound, forward (F_t), adam (the |g| . dw term), flippable (weights
    whose sign could flip by step t), free_by_param (how many per parameter after step 1's update, the
    weights step 2 runs on, flippable[1] in all; which ones in free_masks), margin
    (the smallest |g| / delta over weights with a nonzero delta: how far the nearest gradient is from
    flipping; inf when the layout reorders no gradient), grad_norm (the global norm of each step's
    gradient of the loss, what clipping by norm would compare with its threshold)."""
    cfg = layout3d.config()
    kinds, grads_reordered = reordered(dims)
    dp, m, b = dims.dp, num_microbatches, micro_batch
    ref = layout3d.reference(cfg, dp, m, b, steps, lr, watch=lambda net: rounding.Rounding(net, u),
                             weight_decay=weight_decay, seed=seed)
    tokens = dp * m * b * cfg.seq_len
    scale = 2 * rounding.gamma(tokens, u) if grads_reordered else 0.0
    n = dims.dp * dims.cp                  # the ranks whose gradients one all-reduce adds up
    if u_collective is not None and n > 1:
        scale += 2 * rounding.gamma(n - 1, u_collective)     # a plain sum of n terms (Higham 4.2)
    deltas = [{n: scale * a for n, a in w.absgrad.items()} for w in ref["watched"]]
    drift = weight_drift(ref["adam_grads"], deltas, lr, weight_decay=weight_decay, masks=True)
    drift = [(dw, {n: int(f.sum()) for n, f in free.items()}, free) for dw, free in drift]
    forward = [sum(w.forward[k] for k in kinds) for w in ref["watched"]]
    if u_collective is not None and dims.tp > 1:   # TP's g adds tp partial sums of each row-parallel output
        per = 2 * rounding.gamma(dims.tp - 1, u_collective)
        forward = [f + w.row_parallel * per for f, w in zip(forward, ref["watched"])]
    adam = [0.0] + [sum((ref["grads"][t][n].double().abs() * drift[t - 1][0][n]).sum().item()
                        for n in drift[t - 1][0]) for t in range(1, steps)]
    ratios = [(g.abs() / d)[d > 0] for step_g, step_d in zip(ref["adam_grads"], deltas)
              for g, d in ((step_g[n], step_d[n]) for n in step_g)]
    ratios = torch.cat([r.reshape(-1) for r in ratios]) if ratios else torch.empty(0)
    return {"losses": ref["losses"], "bound": [f + a for f, a in zip(forward, adam)], "forward": forward,
            "adam": adam, "flippable": [0] + [sum(d[1].values()) for d in drift[:steps - 1]],
            "delta_scale": scale,
            "kinds": sorted(kinds),
            "free_by_param": {n: c for n, c in drift[0][1].items() if c} if steps > 1 else {},
            "free_masks": {n: f for n, f in drift[0][2].items() if f.any()} if steps > 1 else {},
            "margin": ratios.min().item() if ratios.numel() else float("inf"), "u": u,
            "grad1": (ref["grads"][0], ref["watched"][0].absgrad, tokens),
            "grad_norm": [sum(g.double().pow(2).sum().item() for g in step.values()) ** 0.5
                          for step in ref["grads"]]}


def key_bias_free(free_masks, cfg):
    """How many weights whose sign is free are key biases, checked to be exactly those: in every layer,
    the free elements of the fused QKV bias are its key slice [h, 2h), no more and no fewer.

    Adding the same b_k to every key adds q . b_k to a whole row of scores, which softmax ignores, so
    the key biases' gradient is zero up to rounding. A count of L h free elements would also pass a
    layout that freed the value biases, or h other elements of each layer: this compares the indices."""
    h, total = cfg.hidden, 0
    for i in range(cfg.n_layer):
        mask = free_masks.get(f"blocks.{i}.attn.qkv.bias")
        free = [] if mask is None else mask.nonzero().flatten().tolist()
        if free != list(range(h, 2 * h)):
            raise ValueError(f"layer {i}: the free QKV bias elements are {free[:4]}... ({len(free)} of "
                             f"them), not exactly the key slice [{h}, {2 * h}).")
        total += len(free)
    return total


def table(names=tuple(VARIANTS), steps=layout3d.STEPS, lr=layout3d.LR, timeout=600, seeds=(0,)):
    """Every variant's loss difference from one process, step by step, beside the bound it is held
    to (its layout's, with weight decay when it trains with it), on the run of each seed in ``seeds``
    (model and batches, `layout3d.step_batches`). ``names``: of `VARIANTS` or `MISPLACED`.

    One job per layout runs all of its variants on every seed. Returns {"rows": {name: row},
    "bounds": {(layout, decay): bound}, "runs": {name: `train3d.summarize` of its run}} for the first
    seed, and "by_seed": {seed: {name: row}}; a row names the first step whose difference is beyond
    the bound (None: inside at every step) and the largest difference / bound."""
    every = {**VARIANTS, **MISPLACED}
    keys = dict.fromkeys((*bound_key(n), s) for n in names for s in seeds)
    bounds = {k: bound(k[0], steps, lr, weight_decay=layout3d.WEIGHT_DECAY if k[1] else 0.0, seed=k[2])
              for k in keys}
    runs = {}
    for layout in dict.fromkeys(every[n][0] for n in names):
        mine = [(n, s) for s in seeds for n in names if every[n][0] == layout]
        runs.update(zip(mine, train3d.run(layout, [every[n][1] for n, _ in mine], steps, lr,
                                          timeout=timeout, seeds=[s for _, s in mine])))
    by_seed = {s: {} for s in seeds}
    for (n, s), run in runs.items():
        b = bounds[(*bound_key(n), s)]
        diff = [abs(x - y) for x, y in zip(run["losses"], b["losses"])]
        ratio = [d / lim if lim else (0.0 if d == 0 else float("inf")) for d, lim in zip(diff, b["bound"])]
        beyond = [t + 1 for t, r in enumerate(ratio) if r > 1]
        grads = gradcheck.compare(run["grad1"], run["coords"], every[n][0], layout3d.config(), *b["grad1"])
        by_seed[s][n] = {"what": every[n][2], "bug": is_bug(n), "diff": diff, "bound": b["bound"],
                         "ratio": ratio, "grads": grads, "grads_pass": gradcheck.passes(grads),
                         "first_step_beyond": beyond[0] if beyond else None, "max_ratio": max(ratio)}
    first = seeds[0]
    return {"rows": by_seed[first], "by_seed": by_seed,
            "runs": {n: r for (n, s), r in runs.items() if s == first},
            "bounds": {k[:2]: b for k, b in bounds.items() if k[2] == first}}
