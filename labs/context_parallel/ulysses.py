"""Chapter 6: DeepSpeed-Ulysses, context parallelism by all-to-all over the heads.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models" (arXiv 2309.14509), §3: each of the cp ranks holds N/cp tokens
of Q, K and V for all heads; an all-to-all hands rank j heads j*h/cp ... (j+1)*h/cp - 1 of every
token, so each rank runs ordinary attention over the full sequence for h/cp heads; a second
all-to-all returns the output to the sequence split. The paper counts 4 all-to-alls per layer
in forward (Q, K, V, O), each moving (cp-1)/cp of a rank's share. cp must divide the heads
(the method's limit) and, with GQA, the KV heads too.

The all-to-all's backward is the reverse all-to-all of the gradient. ``hand=True`` builds it
from isend/irecv (counted messages, `labs.measure.comm`); ``hand=False`` calls all_to_all_single
(`comm.all_to_all`: payloads and formula bytes only).
"""
import torch
import torch.distributed as dist

from labs.measure import comm
from labs.context_parallel import ring_attention as ra


def check_heads(n_head, n_kv_head, cp):
    """Ulysses gives each rank whole heads: cp must divide the query heads and the KV heads."""
    if n_head % cp:
        raise ValueError(f"Ulysses needs cp to divide the query heads: {n_head} heads on cp = {cp}; "
                         f"choose a cp that divides {n_head}.")
    if n_kv_head % cp:
        raise ValueError(f"Ulysses needs cp to divide the KV heads: {n_kv_head} KV heads on cp = {cp}; "
                         f"choose a cp that divides {n_kv_head} (or ring attention, which has no such limit).")


def _hand_all_to_all(x, group):
    """x (cp, ...): slice j goes to rank j; returns (cp, ...) with slice j from rank j."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda i: dist.get_global_rank(group, i)) if group is not None else (lambda i: i)
    out = torch.empty_like(x)
    out[r] = x[r]                                                    # a rank's own slice stays home
    reqs = [comm.isend(x[j].contiguous(), glob(j), group=group) for j in range(n) if j != r]
    reqs += [comm.irecv(out[j], glob(j), group=group) for j in range(n) if j != r]
    for req in reqs:
        req.wait()
    return out


def _all_to_all(x, group, hand):
    if hand:
        return _hand_all_to_all(x, group)
    out = torch.empty_like(x)
    comm.all_to_all(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """The exchange on a (cp, ...) tensor; its adjoint is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group, hand):
        ctx.group, ctx.hand = group, hand
        return _all_to_all(x.contiguous(), group, hand)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g.contiguous(), ctx.group, ctx.hand), None, None


def seq_to_heads(x, group, hand):
    """(B, h, N/cp, d) all heads, my tokens -> (B, h/cp, N, d) my heads, all tokens (rank order)."""
    n = dist.get_world_size(group)
    b, h, t, d = x.shape
    parts = x.reshape(b, n, h // n, t, d).transpose(0, 1)           # (cp, B, h/cp, N/cp, d): head group j
    got = _AllToAll.apply(parts, group, hand)                        # (cp, B, h/cp, N/cp, d): tokens of rank j
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def heads_to_seq(x, group, hand):
    """(B, h/cp, N, d) -> (B, h, N/cp, d): the inverse exchange."""
    n = dist.get_world_size(group)
    b, hl, s, d = x.shape
    parts = x.reshape(b, hl, n, s // n, d).permute(2, 0, 1, 3, 4)   # (cp, B, h/cp, N/cp, d): tokens of rank j
    got = _AllToAll.apply(parts, group, hand)                        # (cp, B, h/cp, N/cp, d): head group j
    return got.transpose(0, 1).reshape(b, hl * n, s // n, d)


def ulysses_attention(q, k, v, table, causal=True, group=None, work=None, hand=True):
    """This rank's attention output (B, h, N/cp, d), computed as h/cp heads over the whole sequence."""
    n = dist.get_world_size(group)
    check_heads(q.shape[1], k.shape[1], n)
    qh, kh, vh = (seq_to_heads(x, group, hand) for x in (q, k, v))  # (B, h/cp, N, d), (B, k/cp, N, d)
    everyone = [c for chunks in table for c in chunks]              # the gathered rows, rank by rank
    out, _ = ra.attend(qh, kh, vh, everyone, everyone, causal, work)
    return heads_to_seq(out, group, hand)


def ulysses_bytes(q_bytes, kv_bytes, cp):
    """Counted bytes one rank sends (hand all-to-all): (cp-1)/cp of Q, K, V, O forward; of dO, dQ,
    dK, dV backward (q_bytes, kv_bytes: this rank's share before the exchange)."""
    per = (cp - 1) * (2 * q_bytes + 2 * kv_bytes) // cp
    return {"forward": per, "backward": per}
