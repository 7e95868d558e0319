"""Chapter 9: activation recomputation (checkpointing) and gradient accumulation, measured.

Four policies on a stack of L tiny GPT blocks (`labs.model.Block`, bf16, dropout off):
- "none": autograd keeps what every op saves, sbh(32 + 2as/h) bytes per layer (Korthikanti et al.
  2022, arXiv 2205.05198, Table 2 with the dropout terms removed: `labs.memory_budget.activations`);
- "full": every block under ``torch.utils.checkpoint``: only each block's input, 2sbh, is kept and the
  block's forward runs again in backward (Chen et al. 2016, arXiv 1604.06174; Korthikanti §5);
- "selective": every block under an op-level policy (``create_selective_checkpoint_contexts``): the
  outputs of the weight matmuls, the LayerNorms and GeLU are saved (MUST_SAVE), everything else is
  recomputed (PREFER_RECOMPUTE): the attention core's q k^T, scaling, mask, softmax and scores @ v,
  the reshapes and the residual adds. The s x s term goes; its cost is the two attention matmuls,
  4hs FLOPs per token and layer (Korthikanti et al. 2022, §5 and Appendix A:
  `compute.recompute_flops_per_token`);
- "every-k": segments of k consecutive blocks, each checkpointed as one unit (Chen et al. 2016, §4:
  with segments of k the forward keeps L/k inputs, and backward holds one segment's activations at a
  time). Chen et al.'s L/k + k, least near k = sqrt(L), counts a checkpoint and a block's activations
  in the same units; in bytes it is (L/k) 2sbh + k A_block, least near k = sqrt(L 2sbh / A_block),
  which is below 1 for these blocks (A_block is many times 2sbh), so full recomputation (k = 1) has the
  lower peak. The extra FLOPs are full's.

Measured, not assumed: the bytes the forward leaves alive for backward are the live storages after
the forward (`memory.PeakMemory`: saved-tensor hooks see the checkpoints' inputs but not what the
selective policy caches, a dispatch mode sees both), FLOPs are counted by ``FlopCounterMode``
(`flops.counting`), gradients are compared with "none"'s. Gradient accumulation is
`labs.recompute.accumulation`.

    python -m labs.recompute.policies --policy selective --json
"""
import functools
import statistics
import time

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from labs.memory_budget import activations, compute
from labs.measure import flops, intervals
from labs.data_parallel import loss_reduction
from labs.measure import memory
from labs import model as tiny

POLICIES = ("none", "full", "selective", "every-k")
aten = torch.ops.aten
# The ops whose outputs the selective policy keeps: the expensive ones (matmuls with weights) and
# those whose outputs backward needs and whose recomputation would drag the matmuls along.
SAVED_OPS = frozenset({aten.addmm.default, aten.mm.default, aten.native_layer_norm.default,
                       aten.gelu.default})


def selective_policy(ctx, op, *args, **kwargs):
    """The op-level policy: save the weight matmuls, norms and GeLU; recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# Timed only: "save-all" runs the selective machinery (a checkpoint whose policy sees every op of the
# forward, and of its replay in backward) but saves every output, so it recomputes nothing.
def save_all_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def config(layers=4, hidden=32, heads=4, seq=16):
    return tiny.GPTConfig(n_layer=layers, hidden=hidden, n_head=heads, seq_len=seq)


def check_policy(policy, layers, k):
    if policy not in POLICIES + ("save-all",):
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}.")
    if policy == "every-k" and (k < 1 or layers % k):
        raise ValueError(f"k={k} must divide the {layers} layers; pick a divisor of {layers}.")


def apply_policy(blocks, policy, k=2):
    """A function x -> output that runs ``blocks`` (a list) under ``policy``; the model is not changed."""
    check_policy(policy, len(blocks), k)

    def segment(chunk):
        return lambda x: functools.reduce(lambda h, blk: blk(h), chunk, x)

    if policy == "none":
        return segment(blocks)
    if policy in ("selective", "save-all"):
        rule = selective_policy if policy == "selective" else save_all_policy
        ctx = functools.partial(create_selective_checkpoint_contexts, rule)
        units = [lambda x, b=b: checkpoint(b, x, use_reentrant=False, context_fn=ctx) for b in blocks]
    else:
        size = 1 if policy == "full" else k
        units = [lambda x, c=segment(blocks[i:i + size]): checkpoint(c, x, use_reentrant=False)
                 for i in range(0, len(blocks), size)]
    return segment(units)


def formula_bytes(policy, cfg, batch, k=2, dtype=torch.bfloat16):
    """Bytes the forward keeps for backward, derived: Korthikanti's per-layer count without dropout
    (16-bit activations; `activations.gpt3_activation_bytes_per_layer`) plus the LayerNorms' mean
    and 1/std (two per layer, `activations.layernorm_stat_bytes`, which the paper leaves out)."""
    s, b, h, a, L = cfg.seq_len, batch, cfg.hidden, cfg.n_head, cfg.n_layer
    if policy in ("full", "every-k"):
        units = L if policy == "full" else L // k
        return units * activations.gpt3_activation_bytes_per_layer(s, b, h, a, recompute="full",
                                                                   dropout=False)
    mode = "selective" if policy == "selective" else "none"
    per_layer = activations.gpt3_activation_bytes_per_layer(s, b, h, a, recompute=mode, dropout=False)
    stats = 2 * s * b * activations.layernorm_stat_bytes(h, dtype)
    return int(L * (per_layer + stats))


def formula_flops(policy, cfg, tokens, seq):
    """Forward and backward FLOPs (PaLM App. B, `compute.flops_per_token`) plus the recomputation."""
    h, L = cfg.hidden, cfg.n_layer
    per_token = compute.flops_per_token(12 * h * h * L, L, h, seq)
    mode = {"none": "none", "selective": "selective"}.get(policy, "full")
    extra = compute.recompute_flops_per_token(12 * h * h, L, h, seq, mode)
    return {"forward": tokens * per_token["forward"], "backward": tokens * (per_token["backward"] + extra),
            "recompute": tokens * extra}


def _step(cfg, batch, policy, k, dtype, seed=0):
    torch.manual_seed(seed)
    blocks = [tiny.Block(cfg).to(dtype) for _ in range(cfg.n_layer)]
    x = torch.randn(batch, cfg.seq_len, cfg.hidden, dtype=dtype, requires_grad=True)   # (B, T, H)
    return blocks, x, apply_policy(blocks, policy, k)


def measure(policy, cfg=None, batch=2, k=2, dtype=torch.bfloat16):
    """One forward and backward under ``policy``: kept bytes, peak, FLOPs, gradients; beside formulas.

    activation_bytes: storages alive after the forward, less the loss (the input x counts: "none"
    saves it for LayerNorm, a checkpoint keeps it); peak_bytes: the highest live storage above the
    weights during forward and backward; flops: counted (early stop off: a recomputed block reruns
    whole, as Megatron's does, so the count can be checked against one forward per block).
    """
    cfg = cfg or config()
    blocks, x, run = _step(cfg, batch, policy, k, dtype)
    # Two identical steps: FlopCounterMode, nested in PeakMemory, would move the peak it measures.
    with set_checkpoint_early_stop(False), memory.PeakMemory(*blocks) as mem:
        loss = run(x).float().sum()
        kept = mem.end_bytes - mem.baseline_bytes - loss.untyped_storage().nbytes()
        loss.backward()
    blocks, x, run = _step(cfg, batch, policy, k, dtype)
    with set_checkpoint_early_stop(False):
        with flops.counting() as fwd:
            loss = run(x).float().sum()
        with flops.counting() as bwd:
            loss.backward()
    tokens, seq = x.shape[0] * x.shape[1], x.shape[1]          # sizes from the tensor actually run
    grads = [x.grad] + [p.grad for blk in blocks for p in blk.parameters()]
    return {"policy": policy, "k": k if policy == "every-k" else None, "layers": cfg.n_layer,
            "activation_bytes": kept, "formula_bytes": formula_bytes(policy, cfg, batch, k, dtype),
            "peak_bytes": mem.peak_net, "forward_flops": fwd.get_total_flops(),
            "backward_flops": bwd.get_total_flops(), "formula_flops": formula_flops(policy, cfg, tokens, seq),
            "grads": grads}


def compare(cfg=None, batch=2, k=2, dtype=torch.bfloat16, policies=POLICIES):
    """Each policy (always with "none"), with ratios to "none": bytes kept (measured and derived), FLOPs
    (measured and derived), and the largest gradient difference from "none"'s."""
    rows = {p: measure(p, cfg, batch, k, dtype) for p in dict.fromkeys(("none", *policies))}
    base = rows["none"]
    total = lambda r: r["forward_flops"] + r["backward_flops"]                       # noqa: E731
    ftotal = lambda r: r["formula_flops"]["forward"] + r["formula_flops"]["backward"]  # noqa: E731
    for r in rows.values():
        r["flops"] = total(r)
        r["flops_ratio_vs_none"] = total(r) / total(base)
        r["formula_flops_ratio_vs_none"] = ftotal(r) / ftotal(base)
        r["bytes_ratio_vs_none"] = r["activation_bytes"] / base["activation_bytes"]
        r["formula_bytes_ratio_vs_none"] = r["formula_bytes"] / base["formula_bytes"]
        r["max_grad_diff_vs_none"] = max(float((g - g0).abs().max())
                                         for g, g0 in zip(r["grads"], base["grads"]))
    for r in rows.values():
        del r["grads"]
    return rows


def timing(cfg=None, batch=4, k=2, repeats=15, dtype=torch.float32, threads=1):
    """Wall-clock seconds of one forward and backward per policy, in rounds: each round times every
    policy once, the order rotating from round to round, after one warm-up round. Each round gives
    one paired ratio per policy, its time over "none"'s in the same round, and
    `labs.measure.intervals` turns the ``repeats`` ratios into a median with its interval and range,
    and a verdict only where the interval excludes 1. One thread: on a shared CPU, threads that wait
    for a busy core time the neighbours, not the policy. One machine, one run: the ratio, not the
    seconds, is the result. "save-all" (the selective machinery, nothing recomputed) is timed beside
    them, and ``selective_over_save_all`` is what recomputing the attention core adds to it."""
    intervals.median_ranks(repeats)                     # refuses too few rounds for an interval
    cfg = cfg or config(layers=4, hidden=128, heads=4, seq=128)
    timed = POLICIES + ("save-all",)
    steps = {p: _step(cfg, batch, p, k, dtype) for p in timed}
    seconds = {p: [] for p in timed}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with set_checkpoint_early_stop(False):
            for i in range(repeats + 1):          # rotating order, so a busy moment hits every policy alike
                order = timed[i % len(timed):] + timed[:i % len(timed)]
                for policy in order:
                    _, x, run = steps[policy]
                    start = time.perf_counter()
                    run(x).sum().backward()
                    if i:                          # the first round warms up and is dropped
                        seconds[policy].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    ratios = {}
    for p in timed:
        iv = intervals.ratio_interval(seconds[p], seconds["none"])
        iv["verdict"] = intervals.verdict(iv, "faster than none", "slower than none", threads)
        ratios[p] = iv
    extra = intervals.ratio_interval(seconds["selective"], seconds["save-all"])
    extra["verdict"] = intervals.verdict(extra, "faster than save-all", "slower than save-all", threads)
    return {"seconds": {p: statistics.median(t) for p, t in seconds.items()}, "ratios": ratios,
            "selective_over_save_all": extra,
            "ratio_vs_none": {p: iv["median"] for p, iv in ratios.items()}, "repeats": repeats}


def notes_claims(h=12288, a=96, s=2048, layers=96, batch=32):
    """The source notes' activation figures for GPT-3 175B (L = 96, s = 2048) against the formula
    the chapter proves on the tiny stack (Korthikanti et al. 2022, Table 2, no tensor parallelism):
    bytes per sample with no recomputation, with full recomputation (each layer's input, 2sbh) and
    with selective, the notes' own rule 2 b s h L x 2 bytes, and the reductions; then a DeepSpeed
    config's batch arithmetic, which DeepSpeed asserts: train_batch_size = micro-batch x accumulation
    x data-parallel world size (``DeepSpeedConfig._batch_assertion``)."""
    per = {r: layers * activations.gpt3_activation_bytes_per_layer(s, 1, h, a, recompute=r)
           for r in ("none", "selective", "full")}
    notes_rule = 2 * 1 * s * h * layers * 2
    return {"per_sample_bytes": per, "batch": batch, "notes_rule_bytes": notes_rule,
            "full_reduction": per["none"] / per["full"],
            "selective_reduction": per["none"] / per["selective"],
            "notes_rule_over_full": notes_rule / per["full"],
            "deepspeed_batch": {g: loss_reduction.global_batch_size(4, 4, g)["sequences"] for g in (2, 4)}}


# --- at scale: the GPT-3 setting of Korthikanti et al. 2022 -------------------------------------

def selective_at_scale(h=12288, a=96, s=2048, layers=96, vocab=51200, dropout=True):
    """Selective recomputation on a GPT-3 175B layer (h = 12288, a = 96, L = 96: Brown et al. 2020,
    Table 2.1; s = 2048, their context window, Section 2.1; V = 51200 as in Korthikanti et al. 2022,
    Table 3), from the formulas the lab proves on the tiny stack: the share of a layer's activation
    bytes it removes (Table 2: 5as/h of 34 + 5as/h with dropout, 2as/h of 32 + 2as/h without) and
    the matmul FLOPs it adds to a training step: one more forward of q k^T and scores @ v, 4hs of
    72h^2 + 12hs per token and layer.

    Korthikanti et al.'s own figure (2.7 %, Section 5) comes from their Appendix A, where the
    hardware FLOPs with selective recomputation are 72BsLh^2 (1 + s/(3h) + V/(12hL)) against the
    model FLOPs' 72BsLh^2 (1 + s/(6h) + V/(12hL)): the attention term is doubled, which adds the
    attention products' forward *and* backward, 12Bs^2h per layer, three times the 4Bs^2h that
    rerunning their forward costs: this is how the arithmetic reproduces their 2.7 % (the appendix's
    own text was not checked here). ``korthikanti_flops_added`` evaluates that ratio."""
    if h % a:
        raise ValueError(f"h={h} is not divisible by a={a}; pick a head count that divides h.")
    none = activations.gpt3_activation_bytes_per_layer(s, 1, h, a, dropout=dropout)
    selective = activations.gpt3_activation_bytes_per_layer(s, 1, h, a, recompute="selective",
                                                            dropout=dropout)
    step = compute.flops_per_token(12 * h * h, 1, h, s)["total"]
    model = 1 + s / (6 * h) + vocab / (12 * h * layers)                  # Korthikanti et al., Appendix A
    return {"memory_removed": 1 - selective / none, "scores_term": (5 if dropout else 2) * a * s / h,
            "selective_flops_added": compute.recompute_flops_per_token(12 * h * h, 1, h, s, "selective")
            / step,
            "full_flops_added": compute.recompute_flops_per_token(12 * h * h, 1, h, s, "full") / step,
            "korthikanti_flops_added": (model + s / (6 * h)) / model - 1}


# Chapter 9's exercises: the answers are computed here, so the book never types them.
EXERCISES = {
    "1": lambda: selective_at_scale()["memory_removed"],
    "2": lambda: selective_at_scale()["selective_flops_added"] * 100,
    # accumulation steps for a global batch of 1024 sequences at micro-batch 2 and dp 64
    "3": lambda: 1024 // loss_reduction.global_batch_size(2, 1, 64)["sequences"],
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "1": [(lambda: selective_at_scale(dropout=False)["memory_removed"],
           "the dropout-free count sbh(32 + 2as/h) for a layer with dropout")],
    "2": [(lambda: selective_at_scale()["korthikanti_flops_added"] * 100,
           "about 2.7 %: the attention products counted again in backward (Korthikanti et al.'s Appendix A "
          "count), or backward's factor 2 left out of the denominator, 4hs/(24h^2 + 4hs), which lands "
          "within 0.4 % of it; the question asks for one extra forward of the two attention products "
          "over a whole step's FLOPs"),
          (lambda: selective_at_scale()["full_flops_added"] * 100, "full recomputation's third")],
    "3": [(1024 // 64, "the micro-batch of 2 left out: 1024 / dp")],
}


def check(question, answer, rel=0.01):
    from labs.measure import exercises
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES)


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Activation recomputation: bytes kept for backward and FLOPs, measured beside "
                   "the formulas.",
                   world_size_default=1)
    p.add_argument("--policy", choices=POLICIES, default="full")
    p.add_argument("--layers", type=cli.at_most(64, "layers of the tiny stack"), default=4)
    p.add_argument("--k", type=cli.positive_int, default=2, help="blocks per checkpointed segment (every-k)")
    p.add_argument("--batch", type=cli.at_most(64, "sequences per batch"), default=2)
    args = cli.parse(p, argv)
    if args.world_size != 1:
        raise ValueError(f"recomputation runs in one process; drop --world-size {args.world_size} or pass 1.")
    check_policy(args.policy, args.layers, args.k)
    cfg = config(layers=args.layers)
    rows = compare(cfg, args.batch, args.k, policies=("none", args.policy))
    r = {key: rows[args.policy][key] for key in ("policy", "k", "layers", "activation_bytes", "formula_bytes",
                                                  "peak_bytes", "flops", "flops_ratio_vs_none",
                                                  "formula_flops_ratio_vs_none", "bytes_ratio_vs_none",
                                                  "max_grad_diff_vs_none")}
    cli.report(r, args, f"{args.policy}: {r['activation_bytes']} bytes kept for backward (formula "
               f"{r['formula_bytes']}), {r['flops']} FLOPs, {r['flops_ratio_vs_none']:.3f}x the "
               "FLOPs of none")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
