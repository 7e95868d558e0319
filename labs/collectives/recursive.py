"""Chapter 10: recursive doubling and halving, and Rabenseifner's all-reduce, on any number of ranks.

Pairing rank r with r XOR 2^k needs a power of two (Thakur, Rabenseifner & Gropp 2005, section 4,
who fold by swapping half-buffers), so with p' = 2^floor(lg p) and r = p - p' the first 2r ranks fold
pairwise first, as MPICH's recursive-doubling all-reduce does, whole buffers: each even rank
i < 2r hands its data to rank i + 1 and sits out; the p' ranks left
(virtual rank v: i // 2 for odd i < 2r, i - r above) run the power-of-two algorithm; at the end
each odd rank i < 2r hands the even rank i - 1 its result (unfold). Two extra rounds, and the
folded data travels twice. Virtual rank v owns the blocks [start(v), start(v + 1)) of the buffer,
start(v) = v + min(v, r) for the p blocks of all-gather / reduce-scatter (the folded pairs own two).

Every message goes through `labs.measure.comm` (counted); `Rounds` counts the exchanges of a rank.
"""
import torch

from labs.measure import comm


class Rounds:
    """How many exchanges this rank took part in (a round: post every message, then wait), and
    ``log``: per exchange, the (dst, bytes) sent and the (src, bytes) received, for the pictures."""

    def __init__(self):
        self.count = 0
        self.log = []

    def exchange(self, sends=(), recvs=()):
        """``sends``: (tensor, dst) pairs; ``recvs``: (tensor, src) pairs; all posted, then awaited."""
        reqs = [comm.isend(t, d) for t, d in sends] + [comm.irecv(t, s) for t, s in recvs]
        for req in reqs:
            req.wait()
        self.count += bool(reqs)
        if reqs:
            size = lambda t: t.numel() * t.element_size()
            self.log.append({"sends": [(d, size(t)) for t, d in sends],
                             "recvs": [(s, size(t)) for t, s in recvs]})


def layout(p):
    """(p2, r): the largest power of two <= p and the number of ranks folded onto it."""
    p2 = 1 << (p.bit_length() - 1)
    return p2, p - p2


def virtual(i, r):
    """Rank i's virtual rank among the p2 that run the power-of-two algorithm, or None if folded."""
    if i < 2 * r:
        return None if i % 2 == 0 else i // 2
    return i - r


def real(v, r):
    """The rank that plays virtual rank v."""
    return 2 * v + 1 if v < r else v + r


def fold_bounds(p, k):
    """Element offsets of virtual ranks' ranges over p blocks of k: the folded pairs own two blocks."""
    p2, r = layout(p)
    return [(v + min(v, r)) * k for v in range(p2 + 1)]


def _double(flat, bounds, v, r, rounds):
    """Recursive doubling over virtual ranks: in round k swap the range of the 2^k virtual ranks
    this one speaks for with partner v XOR 2^k; lg p2 rounds."""
    mask = 1
    while mask < len(bounds) - 1:
        mine, theirs = (v // mask) * mask, ((v ^ mask) // mask) * mask
        rounds.exchange(sends=[(flat[bounds[mine]:bounds[mine + mask]], real(v ^ mask, r))],
                        recvs=[(flat[bounds[theirs]:bounds[theirs + mask]], real(v ^ mask, r))])
        mask *= 2


def _halve(acc, bounds, v, r, rounds):
    """Recursive halving over virtual ranks: send the half of the current range that partner
    v XOR 2^k keeps, add its copy of this rank's half; lg p2 rounds. ``acc`` ends with the sum on
    [bounds[v], bounds[v + 1])."""
    lo, mask = 0, (len(bounds) - 1) // 2
    while mask:
        keep, give = (lo + mask, lo) if v & mask else (lo, lo + mask)
        a, b = bounds[keep], bounds[keep + mask]
        incoming = torch.empty(b - a, dtype=acc.dtype, device=acc.device)
        rounds.exchange(sends=[(acc[bounds[give]:bounds[give + mask]], real(v ^ mask, r))],
                        recvs=[(incoming, real(v ^ mask, r))])
        acc[a:b].add_(incoming)
        lo, mask = keep, mask // 2


def _fold_sum(acc, i, r, rounds):
    """Fold: even rank i < 2r sends its whole buffer to i + 1, which adds it."""
    if i < 2 * r:
        if i % 2 == 0:
            rounds.exchange(sends=[(acc, i + 1)])
        else:
            incoming = torch.empty_like(acc)
            rounds.exchange(recvs=[(incoming, i - 1)])
            acc.add_(incoming)


def _unfold(buf, i, r, rounds):
    """Unfold: odd rank i < 2r sends ``buf`` (its result) to i - 1, which receives it into ``buf``."""
    if i < 2 * r:
        rounds.exchange(**{"recvs" if i % 2 == 0 else "sends": [(buf, i + 1 if i % 2 == 0 else i - 1)]})


def doubling_all_gather(out, shard, rounds, i, p):
    """All-gather: fold (even i < 2r sends its shard to i + 1), doubling over p2, unfold (the whole
    output)."""
    p2, r = layout(p)
    flat, k = out.view(-1), shard.numel()
    flat[i * k:(i + 1) * k].copy_(shard.view(-1))
    if i < 2 * r:
        rounds.exchange(**({"sends": [(shard.view(-1), i + 1)]} if i % 2 == 0
                           else {"recvs": [(flat[(i - 1) * k:i * k], i - 1)]}))
    if virtual(i, r) is not None:
        _double(flat, fold_bounds(p, k), virtual(i, r), r, rounds)
    _unfold(flat, i, r, rounds)
    return out


def halving_reduce_scatter(out, x, rounds, i, p):
    """Reduce-scatter: fold (the whole input), halving over p2, unfold (block i - 1 to rank i - 1)."""
    p2, r = layout(p)
    acc, k = x.clone().view(-1), x.numel() // p   # partial sums; ``x`` is only read
    _fold_sum(acc, i, r, rounds)
    if virtual(i, r) is not None:
        _halve(acc, fold_bounds(p, k), virtual(i, r), r, rounds)
    mine = out.view(-1)
    if i < 2 * r:   # unfold: the odd rank holds its partner's block too
        rounds.exchange(**({"recvs": [(mine, i + 1)]} if i % 2 == 0
                           else {"sends": [(acc[(i - 1) * k:i * k], i - 1)]}))
    if i >= 2 * r or i % 2:
        mine.copy_(acc[i * k:(i + 1) * k])
    return out


def doubling_all_reduce(x, rounds, i, p):
    """All-reduce by recursive doubling: fold, lg p2 swaps of the whole buffer (each added), unfold."""
    p2, r = layout(p)
    flat = x.view(-1)
    _fold_sum(flat, i, r, rounds)
    v, mask, incoming = virtual(i, r), 1, torch.empty_like(flat)
    while v is not None and mask < p2:
        rounds.exchange(sends=[(flat, real(v ^ mask, r))], recvs=[(incoming, real(v ^ mask, r))])
        flat.add_(incoming)
        mask *= 2
    _unfold(flat, i, r, rounds)
    return x


def rabenseifner_all_reduce(x, rounds, i, p):
    """Rabenseifner: fold, halving reduce-scatter and doubling all-gather over p2 equal blocks, unfold."""
    p2, r = layout(p)
    flat = x.view(-1)
    _fold_sum(flat, i, r, rounds)
    v = virtual(i, r)
    if v is not None:
        bounds = [j * flat.numel() // p2 for j in range(p2 + 1)]
        _halve(flat, bounds, v, r, rounds)
        _double(flat, bounds, v, r, rounds)
    _unfold(flat, i, r, rounds)
    return x
