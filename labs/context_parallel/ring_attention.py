"""Chapter 6: ring attention, forward and backward by hand (context parallelism, K/V on a ring).

Ring Attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", arXiv 2310.01889, §3 and Algorithm 1): the sequence is split over cp
ranks; rank r keeps its query block Q_r and passes its key/value block (K_r, V_r) around a ring.
At step t it holds the block of rank r - t, computes that block's attention with the blockwise
(online) softmax of Milakov & Gimelshein 2018 / FlashAttention (Dao et al. 2022, §3.1), and
merges it into its running output with the log-sum-exp L:

    L_new = log(e^L + e^l),  O_new = e^(L - L_new) O + e^(l - L_new) o

while the next block is already on its way (isend/irecv, counted by `labs.measure.comm`).

Backward (FlashAttention-2, Dao 2023, arXiv 2307.08691, §3.1.2, Algorithm 2): with the saved O
and L, P = exp(S - L) is recomputed tile by tile, D = rowsum(dO * O), dS = P * (dP - D). dQ stays
home; K and V go round the ring again, each carrying its accumulators dK and dV, and after cp
steps one last hop hands dK, dV back to the owner of K and V.

A rank holds its query rows as a list of chunks of the global sequence, ``chunks = [(start,
length), ...]`` (one chunk for the contiguous split, two for zig-zag): a tile of a query chunk
against a key chunk is skipped when the causal mask hides all of it, computed without a mask
when it hides none of it (below the diagonal), and with a mask otherwise (on the diagonal). A
masked tile is computed whole, masked entries included, unless ``block`` is given: then the
kernel works in blocks of ``block`` tokens, as FlashAttention does (Dao et al. 2022, §3.1), and
skips the blocks of a diagonal tile that the mask hides, c(c + block)/2 score entries of c^2.
`count` tallies the entries the kernel really computes, which is what FlopCounterMode sees.

GQA (Ainslie et al. 2023): K and V have k heads, query head j reads KV head j // (a/k); the KV
blocks that travel are the small ones.
"""
import time

import torch
import torch.distributed as dist

from labs.measure import comm, timing

NEG_INF = float("-inf")


def split(chunks, block):
    """Cut each (start, length) chunk into pieces of at most ``block`` tokens, in order."""
    return [(s + i, min(block, n - i)) for s, n in chunks for i in range(0, n, block)]


def tiles(q_chunks, k_chunks, causal, device, block=None):
    """(query rows, key rows, mask or None) for every tile the causal mask does not hide entirely.

    With ``block``, a tile on the diagonal is cut into blocks of ``block`` tokens and the blocks the
    mask hides are skipped (the query chunks are expected already cut, see `kernel_tiles`)."""
    qo = 0
    for qs, ql in q_chunks:
        ko = 0
        for ks, kl in k_chunks:
            hidden = causal and ks > qs + ql - 1           # every key after every query
            partial = causal and not hidden and ks + kl - 1 > qs
            if partial and block and kl > block:        # the kernel's blocks: skip those the mask hides
                for qsl, ksl, mask in tiles([(qs, ql)], split([(ks, kl)], block), causal, device):
                    yield slice(qo + qsl.start, qo + qsl.stop), slice(ko + ksl.start, ko + ksl.stop), mask
            elif not hidden:
                mask = None
                if partial:                                  # on the diagonal: key position <= query position
                    mask = (torch.arange(qs, qs + ql, device=device)[:, None]
                            >= torch.arange(ks, ks + kl, device=device)[None, :])
                yield slice(qo, qo + ql), slice(ko, ko + kl), mask
            ko += kl
        qo += ql


def kernel_tiles(q_chunks, k_chunks, causal, device, block=None):
    """The tiles a kernel with query and key blocks of ``block`` tokens computes (None: whole chunks)."""
    return tiles(split(q_chunks, block) if block else q_chunks, k_chunks, causal, device, block)


def _expand(kv, n_head):
    """(B, k, T, d) KV heads -> (B, a, T, d): query head j reads KV head j // (a/k)."""
    return kv.repeat_interleave(n_head // kv.shape[1], dim=1)


def _fold(grad, n_kv):
    """(B, a, T, d) per query head -> (B, k, T, d): a KV head's gradient sums over its a/k query heads."""
    b, a, t, d = grad.shape
    return grad.view(b, n_kv, a // n_kv, t, d).sum(2)


def count(work, q, k, mask):
    """Tally one tile as the kernel computes it: every score entry of it, masked ones included."""
    if work is None:
        return
    b, a, cq, _ = q.shape
    ck = k.shape[2]
    work["tiles_full" if mask is None else "tiles_masked"] += 1
    work["score_entries"] += b * a * cq * ck
    work["unmasked_entries"] += b * a * (cq * ck if mask is None else int(mask.sum()))


def tile_forward(q, k, v, mask, scale, safe=True):
    """One tile's attention and log-sum-exp: o (B, a, cq, d), l (B, a, cq).

    A query row whose keys are all masked has l = -inf; ``safe`` makes its output 0 instead of
    exp(-inf - (-inf)) = NaN, the 0/0 of the softmax normaliser.
    """
    s = q @ _expand(k, q.shape[1]).transpose(-1, -2) * scale       # (B, a, cq, ck)
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)                                 # (B, a, cq)
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse) if safe else lse
    p = torch.exp(s - shift.unsqueeze(-1))                           # masked entries: exp(-inf) = 0
    return p @ _expand(v, q.shape[1]), lse


def merge(out, lse, o, l):
    """Online softmax: fold a block's (o, l) into the running (out, lse); rows not reached stay 0."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    return (out * torch.exp(lse - safe).unsqueeze(-1) + o * torch.exp(l - safe).unsqueeze(-1)), new


def attend(q, k, v, q_chunks, k_chunks, causal, work=None, block=None):
    """Blockwise attention of q (B, a, Tq, d) over k, v (B, k, Tk, d): (out, lse). Differentiable."""
    scale = q.shape[-1] ** -0.5
    b, a, _, d = q.shape
    rows = split(q_chunks, block) if block else q_chunks             # the kernel's query blocks
    outs = [q.new_zeros(b, a, ql, d) for _, ql in rows]              # each query block's running O
    lses = [q.new_full((b, a, ql), NEG_INF) for _, ql in rows]       # and its L: no key seen yet
    first_row = [sum(ql for _, ql in rows[:i]) for i in range(len(rows))]
    for qsl, ksl, mask in tiles(rows, k_chunks, causal, q.device, block):
        i = first_row.index(qsl.start)
        count(work, q[:, :, qsl], k[:, :, ksl], mask)
        o, l = tile_forward(q[:, :, qsl], k[:, :, ksl], v[:, :, ksl], mask, scale)
        outs[i], lses[i] = merge(outs[i], lses[i], o, l)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def tile_backward(q, k, v, mask, scale, do, lse, delta):
    """FlashAttention-2's backward for one tile: (dq, dk, dv), dk and dv folded to the KV heads."""
    ke, ve = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    s = q @ ke.transpose(-1, -2) * scale                             # (B, a, cq, ck)
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - shift.unsqueeze(-1))                           # P recomputed from L, not stored
    dv = p.transpose(-1, -2) @ do                                    # (B, a, ck, d)
    ds = p * (do @ ve.transpose(-1, -2) - delta.unsqueeze(-1))       # dS = P * (dP - D)
    dq = ds @ ke * scale
    dk = ds.transpose(-1, -2) @ q * scale
    return dq, _fold(dk, k.shape[1]), _fold(dv, k.shape[1])


def _pass(tensors, group):
    """Post sends of ``tensors`` to the next rank and receives from the previous one (counted)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda x: dist.get_global_rank(group, x)) if group is not None else (lambda x: x)
    bufs = [torch.empty_like(t) for t in tensors]
    reqs = [comm.isend(t.contiguous(), glob((r + 1) % n), group=group, tag=i) for i, t in enumerate(tensors)]
    reqs += [comm.irecv(b, glob((r - 1) % n), group=group, tag=i) for i, b in enumerate(bufs)]
    return bufs, reqs


def _wait(pending):
    bufs, reqs = pending
    for req in reqs:
        req.wait()
    return bufs


class RingAttention(torch.autograd.Function):
    """O = softmax(Q K^T / sqrt(d)) V for this rank's queries, K/V blocks passed around the ring.

    ``trace`` (a list) receives one entry per forward step: the owner of the block computed, the
    score entries computed, `labs.measure.timing.now` times when the step began, when its compute
    ended and when the next block had arrived (the wait on the left neighbour; on a GPU each is read
    once the compute stream is done, so the compute, not its launch, is timed), and the CPU time of
    the compute (process_time: what the step would take with a core to itself)."""

    @staticmethod
    def forward(ctx, q, k, v, table, causal, group, work, block, trace):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        out = torch.zeros_like(q)                                    # (B, a, T/cp, d)
        lse = q.new_full(q.shape[:-1], NEG_INF)                      # (B, a, T/cp)
        blocks = (k, v)
        for step in range(n):
            owner = (r - step) % n                                   # whose K, V this rank holds now
            began, cpu = timing.now(), time.process_time()
            mine = dict.fromkeys(("tiles_full", "tiles_masked", "score_entries", "unmasked_entries"), 0)
            pending = _pass(blocks, group) if step < n - 1 else None  # the next block is on its way
            o, l = attend(q, blocks[0], blocks[1], table[r], table[owner], causal, mine, block)
            out, lse = merge(out, lse, o, l)
            computed, cpu = timing.now(), time.process_time() - cpu
            if pending:
                blocks = _wait(pending)
            if work is not None:
                for key, value in mine.items():
                    work[key] += value
            if trace is not None:
                trace.append({"step": step, "owner": owner, "score_entries": mine["score_entries"],
                              "began": began, "computed": computed, "arrived": timing.now(),
                              "compute_cpu_s": cpu})
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.table, ctx.causal, ctx.group, ctx.block = table, causal, group, block
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        scale = q.shape[-1] ** -0.5
        delta = (do * out).sum(-1)                                   # D = rowsum(dO * O), (B, a, T/cp)
        dq = torch.zeros_like(q)
        blocks = (k, v, torch.zeros_like(k), torch.zeros_like(v))   # K, V and their travelling dK, dV
        for step in range(n):
            owner = (r - step) % n
            kb, vb, dk, dv = blocks
            for qsl, ksl, mask in kernel_tiles(ctx.table[r], ctx.table[owner], ctx.causal, q.device,
                                               ctx.block):
                g = tile_backward(q[:, :, qsl], kb[:, :, ksl], vb[:, :, ksl], mask, scale,
                                  do[:, :, qsl], lse[:, :, qsl], delta[:, :, qsl])
                dq[:, :, qsl] += g[0]
                dk[:, :, ksl] += g[1]
                dv[:, :, ksl] += g[2]
            if step < n - 1:
                blocks = _wait(_pass(blocks, ctx.group))
            elif n > 1:                                              # the block of rank r + 1: send it home
                dk, dv = _wait(_pass((dk, dv), ctx.group))
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(q, k, v, table, causal=True, group=None, work=None, block=None, trace=None):
    """This rank's attention output (B, a, T/cp, d); ``table[r]`` lists rank r's chunks of the sequence."""
    return RingAttention.apply(q, k, v, table, causal, group, work, block, trace)


def ring_bytes(kv_block_bytes, cp):
    """Counted bytes one rank sends: forward cp-1 hops of K and V; backward cp-1 hops of K, V, dK, dV
    and a last hop of dK, dV home (dK, dV have K's dtype and shape)."""
    if cp == 1:
        return {"forward": 0, "backward": 0}
    return {"forward": 2 * (cp - 1) * kv_block_bytes,
            "backward": 4 * (cp - 1) * kv_block_bytes + 2 * kv_block_bytes}
