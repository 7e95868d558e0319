"""Chapter 6: DeepSpeed-Ulysses, context parallelism by all-to-all over the heads.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models" (arXiv 2309.14509), §3: each of the cp ranks (the paper's P) holds
N/cp tokens of Q, K and V for all a heads; an all-to-all hands rank j the query heads
j a/cp ... (j+1) a/cp - 1 of every token, so each rank runs ordinary attention over the whole
sequence for a/cp heads; a second all-to-all returns the output to the sequence split. The paper's
communication analysis (§3.2) has two all-to-alls per layer: one for Q, K and V together
(aggregate message 3Nh, h the hidden size) and one for the output (Nh), 4Nh/P per link.

``fused=True`` (the default) does what the paper describes: one all-to-all carries Q, K and V,
each rank's slice for rank j in one message; forward is two all-to-alls and backward their two
adjoints. ``fused=False`` does what DeepSpeed's own `DistributedAttention` does
(deepspeed/sequence/layer.py: one all-to-all each for q, k and v, under "TODO Merge three alltoall
calls into one"): the same bytes in four all-to-alls.

Heads. Each rank must get whole query heads: cp must divide a (the method's limit). With GQA the
k KV heads split too when cp divides k; when k divides cp, implementations copy each KV head cp/k
times before the all-to-all, so that each rank gets one (verl's Ulysses,
verl/models/transformers/monkey_patch.py: repeats = max(cp // k, 1), accepting k % cp == 0 or
cp % k == 0). The copies travel: `ulysses_bytes` counts them. The paper's 3Nh assumes K and V as
wide as Q.

The all-to-all's backward is the reverse all-to-all of the gradient. ``hand=True`` builds it from
isend/irecv (counted messages, `labs.measure.comm`); ``hand=False`` calls all_to_all_single
(`comm.all_to_all`: payloads, calls and formula bytes only).
"""
import torch
import torch.distributed as dist

from labs.measure import comm
from labs.context_parallel import ring_attention as ra


def check_heads(n_head, n_kv_head, cp):
    """Ulysses gives each rank whole heads: cp must divide the query heads, and cp and the KV heads
    must divide one another (the KV heads are split, or each copied cp/k times)."""
    if n_head % cp:
        raise ValueError(f"Ulysses needs cp to divide the query heads: {n_head} heads on cp = {cp}; "
                         f"choose a cp that divides {n_head}.")
    if n_kv_head % cp and cp % n_kv_head:
        raise ValueError(f"Ulysses needs cp and the KV heads to divide one another: {n_kv_head} KV heads on "
                         f"cp = {cp}; choose a cp that divides {n_kv_head} or is a multiple of it "
                         f"(or ring attention, which has no such limit).")


def kv_repeats(n_kv_head, cp):
    """Copies of each KV head sent, so that every rank gets whole KV heads: cp/k when k < cp."""
    return max(cp // n_kv_head, 1)


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


def seq_to_heads(tensors, group, hand=True, fused=True):
    """[(B, H_i, N/cp, d)] all heads, my tokens -> [(B, H_i/cp, N, d)] my heads, all tokens (rank order).

    ``fused``: one all-to-all, each message carrying every tensor's heads for its destination."""
    n = dist.get_world_size(group)
    parts = [x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]).transpose(0, 1)
             for x in tensors]                                       # (cp, B, H_i/cp, N/cp, d): head group j
    if fused:
        got = _AllToAll.apply(torch.cat(parts, dim=2), group, hand).split([p.shape[2] for p in parts], dim=2)
    else:
        # (cp, B, H_i/cp, N/cp, d): tokens of rank j
        got = [_AllToAll.apply(p, group, hand) for p in parts]
    return [g.permute(1, 2, 0, 3, 4).reshape(g.shape[1], g.shape[2], n * g.shape[3], g.shape[4]) for g in got]


def heads_to_seq(x, group, hand=True):
    """(B, a/cp, N, d) -> (B, a, N/cp, d): the inverse exchange."""
    n = dist.get_world_size(group)
    b, hl, s, d = x.shape
    parts = x.reshape(b, hl, n, s // n, d).permute(2, 0, 1, 3, 4)   # (cp, B, a/cp, N/cp, d): tokens of rank j
    got = _AllToAll.apply(parts, group, hand)                        # (cp, B, a/cp, N/cp, d): head group j
    return got.transpose(0, 1).reshape(b, hl * n, s // n, d)


def repeat_kv(k, v, cp):
    """Copy each of the k KV heads cp/k times when k < cp (query head j still reads copy j*k/cp)."""
    r = kv_repeats(k.shape[1], cp)
    return (k, v) if r == 1 else (k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1))


def ulysses_attention(q, k, v, table, causal=True, group=None, work=None, hand=True, fused=True, block=None):
    """This rank's attention output (B, a, N/cp, d), computed as a/cp heads over the whole sequence."""
    n = dist.get_world_size(group)
    check_heads(q.shape[1], k.shape[1], n)
    k, v = repeat_kv(k, v, n)                                        # (B, max(k, cp), N/cp, d)
    # (B, a/cp, N, d), (B, max(k, cp)/cp, N, d)
    qh, kh, vh = seq_to_heads([q, k, v], group, hand, fused)
    everyone = [c for chunks in table for c in chunks]              # the gathered rows, rank by rank
    out, _ = ra.attend(qh, kh, vh, everyone, everyone, causal, work, block)
    return heads_to_seq(out, group, hand)


def ulysses_bytes(q_bytes, kv_bytes, cp, kv_heads):
    """Counted bytes one rank sends (hand all-to-all): (cp-1)/cp of Q, K, V, O forward; of dO, dQ,
    dK, dV backward (q_bytes, kv_bytes: this rank's share before the exchange, before any copy of
    the KV heads, which multiplies K's and V's bytes by `kv_repeats`)."""
    per = (cp - 1) * (2 * q_bytes + 2 * kv_bytes * kv_repeats(kv_heads, cp)) // cp
    return {"forward": per, "backward": per}
