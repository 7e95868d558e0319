"""BF16 weights without an FP32 master copy, and FP32 accumulation of 16-bit products (chapter 8).

Micikevicius et al. 2018 ("Mixed Precision Training", arXiv 1710.03740) keep an FP32 master copy
of the weights (section 3.1) because an update smaller than half the spacing of a 16-bit weight
rounds away: w + u == w. Without a master copy the update can be kept two ways (Zamirai et al.
2020, "Revisiting BFloat16 Training", arXiv 2010.06192), both built here by hand on BF16 tensors:
- **stochastic rounding**: round w + u up or down at random, with the probability that makes the
  expected result exact (add 16 random bits below BF16's mantissa to the fp32 value, then truncate);
- **Kahan summation**: a second BF16 tensor c carries what the last addition lost, and the next
  update adds it back: y = u - c; s = w + y; c = (s - w) - y; w = s.
`lost_updates` runs SGD on an elementwise quadratic in four ways (FP32 master, BF16 rounded to
nearest, BF16 stochastic, BF16 Kahan) and measures how far each ends from the FP32 master run.
Every operation is elementwise and seeded, so every CPU gets the same bits.

Section 3.3 of the same paper accumulates the products of 16-bit operands in FP32 and rounds once,
when the result is written. `dot_accumulation` measures a long dot product of BF16 operands added
in a BF16 accumulator against one added in FP32, and torch's own BF16 matrix product beside them.
"""
import torch

BF16 = torch.bfloat16


def round_stochastic(x, generator):
    """fp32 x -> bf16, rounding up or down with probability proportional to the distance: add a
    random 16-bit integer to the fp32 bit pattern, then drop the low 16 bits (truncation)."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32)
    # the carry from the low half into the high half is the rounding up; & ~0xFFFF truncates
    return ((bits + noise) & ~0xFFFF).view(torch.float32).to(BF16)  # exact: the low bits are zero


def spacing(w, u):
    """The gap from bf16 w to its neighbour in the direction of u: 2^(floor(log2 |w|) - 7), halved
    when w is a power of two and u points toward zero (the binade below is twice as dense)."""
    mant, exp = torch.frexp(w.float())
    gap = torch.exp2((exp - 1 - 7).float())
    return torch.where((mant.abs() == 0.5) & (u * w < 0), gap / 2, gap)


def lost_by_rule(w, u):
    """Where rounding to nearest (ties to even) leaves w + u == w: |u| below half the gap, or exactly
    half with w's last mantissa bit even."""
    half = spacing(w, u) / 2
    even = (w.float().view(torch.int32) >> 16) & 1 == 0
    return (u != 0) & ((u.float().abs() < half) | ((u.float().abs() == half) & even))


def problem(n=4096, spread=0.2, seed=0):
    """Weights w0 in [0.5, 2) (exact in bf16) and targets t = w0 + N(0, spread): loss sum (w - t)^2 / 2,
    gradient w - t, so an SGD step moves each weight by -lr (w - t)."""
    g = torch.Generator().manual_seed(seed)
    w0 = (0.5 + 1.5 * torch.rand(n, generator=g)).to(BF16).float()
    return w0, w0 + spread * torch.randn(n, generator=g)


def lost_updates(steps=300, lr=0.01, n=4096, spread=0.2, seed=0):
    """SGD on `problem` for ``steps`` steps, four ways; returns, per method, the fraction of updates
    lost at each step (non-zero u with w + u == w), how far the weights end from the FP32 master
    run's (relative to how far that run moved), and the mean |w - t| at the end.

    The rule it checks: rounding to nearest loses an update u exactly when |u| is below half the
    gap to w's neighbour (`lost_by_rule`), so a weight stalls once lr |w - t| falls under half a
    bf16 spacing, about ulp / (2 lr) from its target. ``rule_mismatches`` counts, over all steps,
    the weights where the measured loss and the rule disagree.
    """
    w0, t = problem(n, spread, seed)
    g = torch.Generator().manual_seed(seed + 1)
    w32 = w0.clone()                                       # the FP32 master
    w = {"nearest": w0.to(BF16), "stochastic": w0.to(BF16), "kahan": w0.to(BF16)}
    c = torch.zeros(n, dtype=BF16)                         # Kahan's compensation, in bf16 too
    lost = {k: [] for k in w}
    mismatches = 0
    for _ in range(steps):
        w32 = w32 - lr * (w32 - t)
        for name, wb in w.items():
            u = (-lr * (wb.float() - t)).to(BF16)          # the update, in bf16 as a bf16 optimizer has it
            if name == "nearest":
                new = wb + u                               # bf16 + bf16, rounded to nearest
                mismatches += int(((new == wb) & (u != 0) != lost_by_rule(wb, u)).sum())
            elif name == "stochastic":
                new = round_stochastic(wb.float() + u.float(), g)
            else:
                y = u - c
                new = wb + y
                c = (new - wb) - y
            lost[name].append(((new == wb) & (u != 0)).double().mean().item())
            w[name] = new
    moved = (w32 - w0).norm()
    out = {"steps": steps, "lr": lr, "n": n, "lost_fraction": lost,
           "distance_to_fp32": {k: ((v.float() - w32).norm() / moved).item() for k, v in w.items()},
           "mean_gap_to_target": {k: (v.float() - t).abs().mean().item() for k, v in w.items()}}
    out["mean_gap_to_target"]["fp32 master"] = (w32 - t).abs().mean().item()
    out["rule_mismatches"] = mismatches
    return out


def dot_accumulation(Ks=(64, 256, 1024, 4096), rows=64, seed=0, to_bf16=lambda x: x.to(BF16)):
    """Mean relative error of BF16 dot products of length K against the exact sum: products added in
    a BF16 accumulator (rounded after every addition), in an FP32 one (rounded to bf16 once, at the
    end, as Micikevicius et al. 2018 section 3.3 write the result), and by torch's bf16 matmul.
    Operands are |N(0, 1)|, so the sum grows with K and every addition meets a larger partial sum.
    ``fp32_unrounded`` is the FP32 accumulator's error before that final rounding: for K positive
    terms added left to right it is at most gamma = (K - 1) u / (1 - (K - 1) u) of the sum, u = 2^-24
    (Higham 2002, "Accuracy and Stability of Numerical Algorithms", section 4.2),
    while the one rounding to bf16 (8 significant bits, eps 2^-7) moves a value by up to half an ulp,
    2^-8 of it, which therefore dominates. ``rows`` holds each row's error for the bf16-rounded
    results; ``to_bf16`` is that final rounding (the tests pass a round-toward-zero one, which must fail)."""
    g = torch.Generator().manual_seed(seed)
    out = {"K": list(Ks), "bf16": [], "fp32": [], "fp32_unrounded": [], "torch_matmul": [],
           "rows": {"fp32": [], "torch_matmul": []}}
    for K in Ks:
        a = torch.randn(rows, K, generator=g).abs().to(BF16)
        b = torch.randn(rows, K, generator=g).abs().to(BF16)
        prods = a.float() * b.float()                      # (R, K): exact, 8 x 8 significant bits
        exact = prods.double().sum(1)
        acc16, acc32 = torch.zeros(rows, dtype=BF16), torch.zeros(rows)
        for k in range(K):                                 # left to right, as a running sum
            acc16 = (acc16.float() + prods[:, k]).to(BF16)
            acc32 = acc32 + prods[:, k]
        lib = (a.unsqueeze(1) @ b.unsqueeze(2)).reshape(rows)   # (R,): torch's bf16 product
        for key, got in (("bf16", acc16), ("fp32", to_bf16(acc32)), ("fp32_unrounded", acc32),
                         ("torch_matmul", lib)):
            err = (got.double() - exact).abs() / exact
            out[key].append(err.mean().item())
            if key in out["rows"]:
                out["rows"][key].append(err.tolist())
    return out


def _lost(args):
    r = lost_updates()
    return r, "\n".join(f"{k}: distance to the FP32 master run {v:.4f}"
                        for k, v in r["distance_to_fp32"].items())


def _dot(args):
    r = dot_accumulation()
    return r, "\n".join(f"K={k}: bf16 accumulator {a:.2e}, fp32 accumulator {b:.2e}, torch bf16 "
                        f"matmul {c:.2e}"
                        for k, a, b, c in zip(r["K"], r["bf16"], r["fp32"], r["torch_matmul"]))


EXPERIMENTS = {"master-weights": _lost, "dot-accumulation": _dot}

if __name__ == "__main__":
    from labs.launcher import cli
    from labs.precision import experiment
    cli.main(lambda: experiment.main(experiments=EXPERIMENTS))
