"""Chapter 5: stage imbalance. The first stage also embeds, the last also runs the LM head and the loss.

With a real vocabulary V the head is no small extra: per token it costs 2hV FLOPs forward (a matmul
with an h x V weight) against a block's 2 P_block + 4hs (`labs.memory_budget.compute`, PaLM Appendix B), and
the last stage also holds the (b, s, V) log-probabilities for backward. Splitting the layers equally
makes the last stage the slowest, and in a pipeline the slowest stage sets the pace.

Measured here, in one process, on the tiny GPT with V = 32,000: per stage, parameter bytes (from
the tensors), activation bytes held from F to B (saved-tensor hooks, `split_backward.measure`),
FLOPs (FlopCounterMode) beside the formula, and forward+backward wall time, for equal layers per
stage and for a rebalanced split (the contiguous split with the smallest largest-stage FLOPs).

At scale, Llama 3 405B (Llama Team 2024, "The Llama 3 Herd of Models", arXiv 2407.21783,
§3.3.2, "Pipeline parallelism improvements"): "To balance the pipeline, we reduce one Transformer
layer each from the first and the last stages, respectively". 126 layers on PP = 16 stages is
16 x 8 - 2: stages of [7, 8, ..., 8, 7] layers. `llama3_405b` compares it, in FLOPs from the
formula, with 8 layers on every stage (a 128-layer model) and with the 126 layers split as evenly
as possible with the short stages last, and runs 1F1B on those per-stage costs (`schedules.simulate`).

`stage_layers` is the book's one stage split (chapters 5, 11 and 14 use it): the layers as evenly as
possible over p * v model chunks, the short chunks at the two ends, chunk c on rank c mod p
(interleaved 1F1B, Narayanan et al. 2021, §2.2). It gives Llama 3's split of 126 layers on 16 stages
([7, 8, ..., 8, 7]) and, with v = 8, its first chunk holding only the embedding and its last only the
head (§3.3.2: "the first model chunk on the first stage has only the embedding"); and Megatron-LM's
equal split when p * v divides the layers.
"""
import itertools
import statistics
import time

import torch
import torch.nn as nn

from labs.memory_budget import compute
from labs import model as tiny
from labs.measure import intervals
from labs.formulas import schedules
from labs.pipeline import executor, split_backward
from labs.formulas.stages import (  # the formulas' home is the torch-free core
    split_counts as split_counts, stage_layers as stage_layers)

REAL_VOCAB = 32_000


def config(vocab_size=REAL_VOCAB, hidden=256, n_layer=24):
    """The tiny GPT with a real vocabulary; h = 256 keeps one process on a CPU under a second per
    step while the head is still worth many layers: 2hV / (24h^2 + 4hs) = 10.3 layers' FLOPs."""
    return tiny.GPTConfig(vocab_size=vocab_size, hidden=hidden, n_layer=n_layer, n_head=4, seq_len=16)


def flops_per_token(cfg, layers, first, last):
    """Forward + backward FLOPs per token of a stage (PaLM Appendix B; backward = 2 x forward):
    per layer 2 * 12h^2 (qkv, proj, fc, proj) + 4hs (q k^T, scores @ v) forward; the head 2hV
    forward on the last stage; the embeddings are lookups, no FLOPs."""
    h, s = cfg.hidden, cfg.seq_len
    forward = layers * (2 * 12 * h * h + 4 * h * s) + (2 * h * cfg.vocab_size if last else 0)
    return 3 * forward


def balanced(cfg, p):
    """Layers per stage: the contiguous split with the smallest largest-stage FLOPs (ties: the most
    even), found by trying every split; a stage may hold no layer (the head alone)."""
    n = cfg.n_layer
    if p < 1 or n < 1:
        raise ValueError(f"need at least one stage and one layer (got p={p}, n_layer={n}).")
    if _count(n, p) > 200_000:
        raise ValueError(f"{n} layers on {p} stages have too many splits to try; use fewer stages or layers.")
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), p - 1):
        edges = (0, *cuts, n)
        counts = [edges[i + 1] - edges[i] for i in range(p)]
        cost = [flops_per_token(cfg, c, i == 0, i == p - 1) for i, c in enumerate(counts)]
        key = (max(cost), sum(c * c for c in counts))
        if best is None or key < best[0]:
            best = (key, counts)
    return best[1]


def _count(n, p):
    from math import comb
    return comb(n + p - 1, p - 1)


def equal(cfg, p):
    if cfg.n_layer % p:
        raise ValueError(f"{cfg.n_layer} layers do not split equally over {p} stages; choose p dividing it.")
    return [cfg.n_layer // p] * p


class Stage(executor.Piece):
    """A `executor.Piece` whose first and last are given: with a head-only last stage, the stage
    before it ends at the last layer but must not run the head."""

    def __init__(self, net, lo, hi, first, last):
        nn.Module.__init__(self)
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(net.blocks[lo:hi])
        self.tok_emb, self.pos_emb = (net.tok_emb, net.pos_emb) if first else (None, None)
        self.ln_f, self.head = (net.ln_f, net.head) if last else (None, None)


def pieces(net, counts):
    edges = list(itertools.accumulate(counts, initial=0))
    p = len(counts)
    return [Stage(net, edges[i], edges[i + 1], i == 0, i == p - 1) for i in range(p)]


def _time(piece, args, grad, repeats):
    """Median wall time of forward + backward of one micro-batch through ``piece``."""
    out = []
    for _ in range(repeats + 1):               # the first run warms up autograd and the allocator
        t0 = time.perf_counter()
        torch.autograd.backward(piece(*args), grad)
        out.append(time.perf_counter() - t0)
        piece.zero_grad(set_to_none=True)
    return statistics.median(out[1:])


def measure(cfg=None, p=4, batch_size=2, repeats=3, timed=True):
    """Per stage, for ``equal`` and ``balanced`` layer counts: parameter bytes (tensors), activation
    bytes held from F to B (hooks), FLOPs counted and by formula, and forward+backward seconds."""
    cfg = cfg or config()
    net = tiny.build(cfg, seed=0)
    x, y = tiny.synthetic_batch(cfg, batch_size, seed=0)
    h, tokens = cfg.hidden, x.numel()
    layer_params = sum(q.numel() * q.element_size() for q in net.blocks[0].parameters())
    out = {"vocab": cfg.vocab_size, "hidden": h, "layers": cfg.n_layer, "p": p, "tokens": tokens,
           "layer_param_bytes": layer_params, "splits": {}}
    for name, counts in (("equal", equal(cfg, p)), ("balanced", balanced(cfg, p))):
        stages = []
        for i, piece in enumerate(pieces(net, counts)):
            args = (x if piece.first else torch.randn(*x.shape, h, requires_grad=True), y)
            grad = None if piece.last else torch.randn(*x.shape, h)
            m = split_backward.measure(piece, args, grad)
            piece.zero_grad(set_to_none=True)
            stages.append({"layers": counts[i],
                           "param_bytes": sum(q.numel() * q.element_size() for q in piece.parameters()),
                           "activation_bytes": m["activation_bytes_F"],
                           "flops": m["flops_forward"] + m["flops_backward_full"],
                           "flops_formula": tokens * flops_per_token(cfg, counts[i], piece.first, piece.last),
                           "seconds": _time(piece, args, grad, repeats) if timed else None})
        out["splits"][name] = stages
    return out


def time_splits(cfg=None, p=4, batch_size=2, repeats=8):
    """Forward + backward seconds of every stage of the ``equal`` and the ``balanced`` split, timed in
    turns: each repeat times every stage of one split, then of the other (the order alternating),
    so a burst of load falls on both. Within a round the stage order rotates: round k starts at
    stage k mod p, so over a multiple of p rounds each stage runs first (and last) equally often,
    and a stage's place in the round does not follow it. Returns per split a list of ``repeats``
    lists of per-stage seconds, indexed by stage, after one untimed warm-up round
    (`labs.measure.intervals` pairs them)."""
    cfg = cfg or config()
    net = tiny.build(cfg, seed=0)
    x, y = tiny.synthetic_batch(cfg, batch_size, seed=0)
    h, work = cfg.hidden, {}
    for name, counts in (("equal", equal(cfg, p)), ("balanced", balanced(cfg, p))):
        work[name] = [(piece, (x if piece.first else torch.randn(*x.shape, h, requires_grad=True), y),
                       None if piece.last else torch.randn(*x.shape, h)) for piece in pieces(net, counts)]
    out = {name: [] for name in work}
    for k in range(repeats + 1):
        for name in (("equal", "balanced") if k % 2 else ("balanced", "equal")):
            times = [0.0] * p
            for i in rotation(p, k - 1):
                piece, args, grad = work[name][i]
                t0 = time.perf_counter()
                torch.autograd.backward(piece(*args), grad)
                times[i] = time.perf_counter() - t0
                piece.zero_grad(set_to_none=True)
            if k:                                 # round 0 warms up autograd and the allocator
                out[name].append(times)
    return out


def rotation(p, k):
    """The stage order of timed round ``k`` (from 0): k mod p first, then on around the ring."""
    return [(k + j) % p for j in range(p)]


def stage_ratio(rounds, num, den):
    """Stage ``num``'s time over stage ``den``'s, paired round by round (`time_splits`), with the
    median's interval (`labs.measure.intervals.ratio_interval`). The pair is chosen before the
    times are seen: each round's slowest stage over its fastest would be >= 1 by construction, an
    interval that could never reach below 1 even for equal stages."""
    return intervals.ratio_interval([t[num] for t in rounds], [t[den] for t in rounds])


def llama3_405b(m=16, p=16):
    """Per-stage FLOPs per sequence of 8,192 tokens (formula, `compute.flops_per_token` per layer
    at s = 8,192; head 6hV forward + backward; embedding 0) for four splits, and 1F1B on them.
    The attention term is non-causal, all s x s scores (4hs per token forward); with a causal mask
    whose masked half is skipped it is 2hs: head_in_layers_causal.

    step: the simulated 1F1B step (F = 1/3, B = 2/3 of a stage's FLOPs); step_gpipe: GPipe's.
    bound: sum_s t_s + (m-1) max_s t_s, GPipe's step exactly (a flow shop of m identical jobs),
    1F1B's exactly when the last stage is the slowest (the chapter's dropdown derives both);
    pace: the simulated step's growth per extra micro-batch.
    """
    from labs.memory_budget.budget import MODELS
    arch, seq = MODELS["405B"], 8192
    params = compute.llama_block_params(arch.hidden, arch.heads, arch.kv_heads, arch.ffn)
    block = params["matmul"]
    layer = seq * (3 * (2 * block + 4 * arch.hidden * seq))     # one layer, one sequence, F + B
    head = seq * 3 * 2 * arch.hidden * arch.vocab
    splits = {"equal_128": [8] * p,                              # the 16 x 8 the paper takes one from
              "first_126": [7, 7] + [8] * (p - 2),               # as even as possible, short stages first
              "even_126": [8] * (p - 2) + [7, 7],                # as even as possible, short stages last
              # §3.3.2: one fewer, first and last
              "llama3_126": [len(s) for s in stage_layers(arch.layers, p)]}
    causal = seq * (3 * (2 * block + 2 * arch.hidden * seq))   # the masked half skipped
    out = {"layer_flops": layer, "head_flops": head, "head_in_layers": head / layer, "m": m, "p": p,
           "head_in_layers_causal": head / causal, "splits": {}}
    for name, counts in splits.items():
        t = [c * layer + (head if s == p - 1 else 0) for s, c in enumerate(counts)]   # ints: exact
        costs = [{"F": x // 3, "B": 2 * x // 3, "W": 0} for x in t]
        def step(mm, build=schedules.one_f_one_b):
            return max(e for tl in schedules.simulate(build(p, mm), costs) for _, _, e in tl)
        total = step(m)
        weights = [c * params["total"] + (arch.vocab * arch.hidden if s == 0 else 0)
                   + (arch.vocab * arch.hidden + arch.hidden if s == p - 1 else 0)
                   for s, c in enumerate(counts)]
        out["splits"][name] = {"layers": counts, "stage_flops": t, "stage_params": weights,
                               "max_stage": max(t), "step": total, "bound": sum(t) + (m - 1) * max(t),
                               "pace": step(m + 1) - total, "step_gpipe": step(m, schedules.gpipe),
                               "busy_fraction": m * sum(t) / (p * total),
                               "slowest": [s for s in range(p) if t[s] == max(t)]}
    return out


def llama3_405b_interleaved(m=16, p=16, v=8):
    """Interleaved 1F1B on Llama 3 405B's chunks (formula FLOPs, as `llama3_405b`): v = 8 chunks
    of one layer per stage, 128 chunks for 126 layers, chunk k on stage k mod p. Llama 3's
    (section 3.3.2): the first chunk holds only the embedding, the last only the head and loss;
    short chunks first: chunks 0 and 1 empty; short chunks last: chunks 126 and 127 empty (the
    head on the last). Returns each split's simulated step, F = 1/3 and B = 2/3 of a chunk's FLOPs."""
    l3 = llama3_405b(m, p)
    layer, head, n = l3["layer_flops"], l3["head_flops"], p * v
    splits = {"llama3_126": [0] + [1] * (n - 2) + [0], "first_126": [0, 0] + [1] * (n - 2),
              "even_126": [1] * (n - 2) + [0, 0], "equal_128": [1] * n}
    out = {"layer_flops": layer, "m": m, "p": p, "v": v, "splits": {}}
    for name, counts in splits.items():
        cost = [[None] * v for _ in range(p)]
        for k, c in enumerate(counts):
            x = c * layer + (head if k == n - 1 else 0)
            cost[k % p][k // p] = {"F": x // 3, "B": 2 * x // 3, "W": 0}
        timeline = schedules.simulate(schedules.build("interleaved", p, m, v), cost, v)
        out["splits"][name] = {"layers": counts, "step": max(e for tl in timeline for _, _, e in tl)}
    return out

