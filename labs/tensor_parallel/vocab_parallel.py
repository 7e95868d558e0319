"""Chapter 4: the vocabulary split over tp ranks, embedding and cross-entropy, built by hand.

Shoeybi et al. 2019 (arXiv 1909.08053), §3: the input embedding E is split along the vocabulary,
E = [E_1, E_2], shared with the output layer, and the parallel GEMM's output is fused with the
cross-entropy so that only b x s numbers cross ranks, never the b x s x V logits. Megatron-LM's
VocabParallelEmbedding and _VocabParallelCrossEntropy (megatron/core/tensor_parallel/layers.py,
cross_entropy.py) are the reference implementation.

Rank i holds rows [i V/tp, (i+1) V/tp) of the embedding E (V x h) and of the head W (V x h):
- embedding: a token outside the rank's range looks up row 0 and its output is zeroed (masked);
  one all-reduce (sum) of the b x s x h outputs gives every rank the full lookup;
- head: column-parallel (labs.tensor_parallel.megatron.ColumnParallelLinear, behind f), logits z_i of shape
  (b, s, V/tp): this rank's slice, never gathered;
- loss, l = log sum_v exp(z_v) - z_t, with three all-reduces of b x s numbers each:
  1. max_v z_v (MAX), subtracted so exp cannot overflow (fp32 exp overflows past z = 88.7; the check
     runs the loss at logits near 1e3 as well, where a SUM of the ranks' maxima or no shift gives
     a loss of -inf (SUM of maxima) or +inf with nan gradients (no shift): `large_logits`, with those two
     mistakes in `SHIFTS`);
  2. the target logit z_t (SUM: only the rank that owns t contributes a non-zero);
  3. sum_v exp(z_v - max) (SUM).
  Backward needs no communication: dl/dz_v = softmax_v - [v = t], each rank for its own slice.
V must be divisible by tp: the lab refuses otherwise (`check_vocab`). Megatron instead pads V up
to a multiple of 128 * tp (``--make-vocab-size-divisible-by``); the padded rows' logits then enter
the softmax, so its loss is that of a V' vocabulary model, not the unsharded V one this lab proves.

    python -m labs.tensor_parallel.vocab_parallel --world-size 2 --json
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labs.measure import comm, memory
from labs.launcher import launch, preflight
from labs.tensor_parallel import megatron


def check_vocab(vocab, tp):
    """Refuse a tp that does not divide V, before any process starts."""
    if vocab % tp:
        raise ValueError(f"the vocabulary V = {vocab} is not divisible by tp = {tp}; choose a tp "
                         "that divides V (padding V, as Megatron does, would put padded logits in "
                         "the softmax).")
    return vocab // tp


def vocab_range(vocab, tp, rank):
    """[start, end): the token ids rank ``rank`` owns."""
    per = check_vocab(vocab, tp)
    return rank * per, (rank + 1) * per


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class VocabParallelEmbedding(nn.Module):
    """E_i, this rank's V/tp rows of the embedding; tokens it does not own give zeros before the sum."""

    def __init__(self, full, group=None):
        super().__init__()
        self.group = group
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.start, self.end = vocab_range(full.num_embeddings, tp, rank)
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.end].clone())

    def forward(self, ids):                                   # (b, s) -> (b, s, h)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)     # any valid row; its output is zeroed
        out = F.embedding(local, self.weight) * ~outside.unsqueeze(-1)  # the zero also stops its gradient
        return _Reduce.apply(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from the logits slice z_i (b, s, V/tp); three all-reduces of (b, s) in forward."""

    @staticmethod
    def forward(ctx, logits, target, start, group, shift="max"):
        logits = logits.float()                               # the loss in fp32, as Megatron
        z_max = logits.max(dim=-1).values                     # (b, s)
        op = dist.ReduceOp.SUM if shift == "sum" else dist.ReduceOp.MAX  # "sum": a named mistake
        comm.all_reduce(z_max, op=op, group=group)            # 1. global max
        if shift == "none":                                   # a named mistake: nothing subtracted
            z_max = torch.zeros_like(z_max)
        logits = logits - z_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + logits.size(-1))
        local = (target - start).masked_fill(outside, 0)
        z_t = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)  # (b, s)
        comm.all_reduce(z_t, group=group)                     # 2. the target logit, from its owner
        exp = logits.exp_()                                   # in place: the shifted logits are not kept
        sum_exp = exp.sum(dim=-1)                             # (b, s)
        comm.all_reduce(sum_exp, group=group)                 # 3. the softmax denominator
        softmax = exp.div_(sum_exp.unsqueeze(-1))             # (b, s, V/tp), kept for backward
        ctx.save_for_backward(softmax, local, outside)
        return sum_exp.log() - z_t                            # l = log sum exp(z - max) - (z_t - max)

    @staticmethod
    def backward(ctx, grad):                                  # (b, s)
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -(~outside).unsqueeze(-1).to(g.dtype))  # - [v = t]
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits, target, start, group=None, shift="max"):
    """Per-token cross-entropy (b, s) from this rank's logits slice, whose first token id is ``start``.

    ``shift`` is "max" (the global maximum, subtracted before exp); "sum" and "none" are the two
    mistakes `large_logits` shows the checks refuse."""
    return _VocabParallelCrossEntropy.apply(logits, target, start, group, shift)


# The shift before exp: the right one, and two named mistakes (a SUM of the ranks' maxima; none)
SHIFTS = ("max", "sum", "none")
LARGE_LOGIT = 1e3   # the largest logit of `large_logits`: far past where fp32 exp overflows (88.7)


def large_logits(rank, world_size, b=2, s=8, vocab=96, scale=LARGE_LOGIT, shifts=SHIFTS):
    """The loss on logits whose largest is ``scale`` (1e3: fp32 exp overflows past 88.7), beside
    `F.cross_entropy` on the whole logits, for each way of shifting them in ``shifts``.

    Returns shift -> {"loss", "loss_ref", "grad": (this rank's logit gradient, the unsharded one's
    slice)}. With the global max subtracted the loss is finite and equal; a SUM of the ranks' maxima
    shifts every logit far below 0 and exp underflows (-inf), no shift overflows exp (inf, nan).
    """
    dev = launch.device()
    g = torch.Generator().manual_seed(2)
    z = torch.randn(b, s, vocab, generator=g)
    z = (z * (scale / z.abs().max())).to(dev)
    target = torch.randint(vocab, (b, s), generator=g).to(dev)
    ref = z.clone().requires_grad_()
    loss_ref = F.cross_entropy(ref.flatten(0, 1), target.flatten())
    loss_ref.backward()
    start, end = vocab_range(vocab, world_size, rank)
    out = {}
    for shift in shifts:
        local = z[..., start:end].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, start, None, shift).mean()
        loss.backward()
        out[shift] = {"loss": loss.detach().cpu(), "loss_ref": loss_ref.detach().cpu(),
                      "grad": (local.grad.cpu(), ref.grad[..., start:end].cpu())}
    return out


def gaps(result):
    """(relative loss gap, gradient gap relative to the largest) of one `large_logits` entry; nan or
    inf when the loss is not finite, so that no bound accepts it."""
    loss, ref = result["loss"].item(), result["loss_ref"].item()
    local, full = result["grad"]
    if not (torch.isfinite(result["loss"]) and torch.isfinite(local).all()):
        return float("nan"), float("nan")
    return abs(loss - ref) / abs(ref), ((local - full).abs().max() / full.abs().max()).item()


def _full_layers(vocab, hidden):
    torch.manual_seed(0)
    return nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False)


def check(rank, world_size, b=2, s=8, hidden=16, vocab=96):
    """Embedding -> head -> loss, split over the vocabulary, beside the unsharded layers.

    Returns the losses (``loss``, ``loss_ref``), the gradients of this rank's slices and of the
    unsharded weights cut to that slice (``grads``: name -> (local, reference)), the all-reduces
    counted by labs.measure.comm (``counts``: for the embedding forward, the loss forward and the backward,
    calls and payload bytes read from the tensors handed to the collective), and the logits memory
    (``logits_bytes``: the logits tensor this rank held, and the unsharded one; ``loss_saved_bytes``:
    what the loss kept for backward, by storage, sharded and unsharded).
    """
    check_vocab(vocab, world_size)
    dev = launch.device()
    emb_full, head_full = (m.to(dev) for m in _full_layers(vocab, hidden))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(vocab, (b, s), generator=g).to(dev)
    target = torch.randint(vocab, (b, s), generator=g).to(dev)

    # the unsharded reference: the whole (b, s, V) logits on one process
    logits_ref = head_full(emb_full(ids))
    with memory.saved_for_backward() as saved_ref:
        loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), target.flatten())
    loss_ref.backward()

    start, end = vocab_range(vocab, world_size, rank)
    emb = VocabParallelEmbedding(emb_full, None)
    # f: all-reduce in backward
    head = megatron.ColumnParallelLinear(head_full, None, torch.arange(start, end))
    with comm.counting() as count_emb:
        x = emb(ids)                                          # (b, s, h), the full lookup on every rank
    logits = head(x)                                          # (b, s, V/tp)
    with comm.counting() as count_loss, memory.saved_for_backward() as saved:
        loss = vocab_parallel_cross_entropy(logits, target, start).mean()
    with comm.counting() as count_bwd:
        loss.backward()
    grads = {"embedding": (emb.weight.grad, emb_full.weight.grad[start:end]),
             "head": (head.weight.grad, head_full.weight.grad[start:end])}
    counts = {name: {"calls": t.calls("all_reduce"), "payloads": list(t.ops["all_reduce"]["payloads"])}
              for name, t in (("embedding", count_emb), ("loss", count_loss), ("backward", count_bwd))}
    return {"loss": loss.detach().cpu(), "loss_ref": loss_ref.detach().cpu(),
            "grads": {k: (a.cpu(), r.cpu()) for k, (a, r) in grads.items()}, "counts": counts,
            "logits_shape": tuple(logits.shape), "logits_dtype": str(logits.dtype),
            "logits_bytes": {"per_rank": logits.numel() * logits.element_size(),
                             "unsharded": logits_ref.numel() * logits_ref.element_size()},
            "loss_saved_bytes": {"per_rank": saved.bytes, "unsharded": saved_ref.bytes},
            "params": {"per_rank": emb.weight.numel() + head.weight.numel(),
                       "unsharded": emb_full.weight.numel() + head_full.weight.numel()},
            "large_logits": large_logits(rank, world_size, b, s, vocab)}


def logits_bytes_at_scale(b=1, s=8192, vocab=128256, tp=8, bytes_per_elem=4):
    """The fp32 logits one rank holds for the loss, unsharded (b s V) and vocabulary-parallel (b s V/tp)."""
    per = check_vocab(vocab, tp)
    return {"unsharded": b * s * vocab * bytes_per_elem, "per_rank": b * s * per * bytes_per_elem,
            "all_reduce_payload_bytes": 3 * b * s * 4}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Vocabulary-parallel embedding and cross-entropy against the unsharded loss.")
    p.add_argument("--vocab", type=cli.positive_int, default=96)
    args = cli.parse(p, argv)
    check_vocab(args.vocab, args.world_size)
    # fp32: embedding and head (V x h each) with gradients, the reference's b*s*V logits, softmax and
    # gradient (a generous x4), so an impossible --vocab is refused before any rank starts
    preflight.check_fits(args.world_size, 4 * (4 * args.vocab * 16 + 4 * 2 * 8 * args.vocab), "--vocab")
    results = launch.launch(check, args.world_size, vocab=args.vocab, timeout=args.timeout)
    if results is None:
        return
    r = results[0]
    out = {"loss": r["loss"].item(), "loss_ref": r["loss_ref"].item(), "world_size": len(results),
           "allreduce_calls": {k: v["calls"] for k, v in r["counts"].items()},
           "logits_bytes": r["logits_bytes"]}
    cli.report(out, args,
               f"vocab-parallel loss {out['loss']:.6f} vs unsharded {out['loss_ref']:.6f}; all-reduces "
               f"{out['allreduce_calls']}; logits {r['logits_bytes']['per_rank']} bytes per rank vs "
               f"{r['logits_bytes']['unsharded']} unsharded")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
