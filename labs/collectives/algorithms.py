"""Chapter 10: every collective built from point-to-point messages, one function per algorithm.

Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 19(1), 2005): broadcast and reduce as binomial trees, all-gather as a ring or by recursive
doubling, reduce-scatter by recursive halving, all-reduce by recursive doubling or as Rabenseifner's
halving reduce-scatter then doubling all-gather, all-to-all by pairwise exchange, each costed as
alpha + n beta per message. The ring all-reduce, a ring reduce-scatter then a ring all-gather, is
the bandwidth-optimal algorithm of Patarasuk & Yuan (2009). The recursive algorithms, and the fold
that lets them run on any p, are `labs.collectives.recursive`. Every function counts the exchanges
this rank takes part in through one counter (``rounds``, `recursive.Rounds`), and every message
goes through `labs.measure.comm`. `HAND` names them by (op, algorithm); `labs.collectives.toolkit`
checks each against its cost formula and the library's collective.
"""
import torch
import torch.distributed as dist

from labs.collectives import recursive

OPS = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce", "all_to_all")
CHOICES = {"broadcast": ("tree",), "reduce": ("tree",), "all_gather": ("ring", "recursive_doubling"),
           "reduce_scatter": ("ring", "recursive_halving"),
           "all_reduce": ("ring", "recursive_doubling", "rabenseifner"), "all_to_all": ("pairwise",)}


def _rank_and_size():
    return dist.get_rank(), dist.get_world_size()


def tree_broadcast(x, rounds, root=0):
    """Binomial tree (TRG 2005): in round k every rank v < 2^k (relative to the root)
    that holds the data sends it to v + 2^k; ceil(lg p) rounds."""
    p, r = dist.get_world_size(), dist.get_rank()
    v, mask = (r - root) % p, 1
    while mask < p:
        if v < mask and v + mask < p:
            rounds.exchange(sends=[(x, (v + mask + root) % p)])
        elif mask <= v < 2 * mask:
            rounds.exchange(recvs=[(x, (v - mask + root) % p)])
        mask *= 2
    return x


def tree_reduce(x, rounds, root=0):
    """The broadcast tree run backwards: in round k a rank with bit k set sends its partial sum to
    v - 2^k and stops; the others add what v + 2^k sends. ``x`` holds the sum on the root only."""
    p, r = dist.get_world_size(), dist.get_rank()
    v, mask, incoming = (r - root) % p, 1, torch.empty_like(x)
    while mask < p:
        if v & mask:
            rounds.exchange(sends=[(x, (v - mask + root) % p)])
            break
        if v + mask < p:
            rounds.exchange(recvs=[(incoming, (v + mask + root) % p)])
            x.add_(incoming)
        mask *= 2
    return x


def _ring(ranks):
    """(p, i, right, left): the ring ``ranks`` (global ranks in ring order; None: every rank), this
    rank's position i on it and its neighbours' global ranks."""
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    i = ranks.index(dist.get_rank())
    return len(ranks), i, ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)]


def ring_all_gather(out, shard, rounds, ranks=None):
    """Ring (TRG 2005): in round s = 0..p-2 position i passes block (i - s) mod p to its right and
    receives block (i - 1 - s) mod p from its left; p-1 rounds of one block each."""
    p, i, right, left = _ring(ranks)
    blocks = out.view(-1).chunk(p)
    blocks[i].copy_(shard.view(-1))
    for s in range(p - 1):
        rounds.exchange(sends=[(blocks[(i - s) % p], right)], recvs=[(blocks[(i - 1 - s) % p], left)])
    return out


def ring_reduce_scatter(out, x, rounds, ranks=None):
    """Ring: in round s = 0..p-2 position i sends right its partial sum of block (i - 1 - s) mod p
    (its own input at s = 0) and adds its input to block (i - 2 - s) mod p arriving from the left;
    after p-1 rounds it holds block i of the sum. ``x`` is only read."""
    p, i, right, left = _ring(ranks)
    blocks = x.view(-1).chunk(p)
    outgoing = blocks[(i - 1) % p]
    for s in range(p - 1):
        j = (i - 2 - s) % p
        incoming = torch.empty_like(blocks[j])
        rounds.exchange(sends=[(outgoing, right)], recvs=[(incoming, left)])
        outgoing = incoming.add_(blocks[j])
    return out.view(-1).copy_(outgoing).view(out.shape)


def doubling_all_gather(out, shard, rounds):
    """Recursive doubling (TRG 2005): in round k a rank swaps the blocks it holds with r XOR 2^k;
    lg p rounds and (p-1)/p of ``out`` sent when p = 2^k, folded otherwise (`labs.collectives.recursive`)."""
    return recursive.doubling_all_gather(out, shard, rounds, *_rank_and_size())


def halving_reduce_scatter(out, x, rounds):
    """Recursive halving (TRG 2005): in round k a rank sends the half of its range that r XOR 2^k
    keeps and adds the partner's copy of its own half; rank r ends with block r of the sum."""
    return recursive.halving_reduce_scatter(out, x, rounds, *_rank_and_size())


def ring_all_reduce(x, rounds, ranks=None):
    """Ring reduce-scatter then ring all-gather (Patarasuk & Yuan 2009): 2(p-1) rounds, each rank
    sending 2(p-1)/p of ``x``, the least any all-reduce can send. In place."""
    p = _ring(ranks)[0]
    block = torch.empty(x.numel() // p, dtype=x.dtype, device=x.device)
    ring_reduce_scatter(block, x, rounds, ranks)
    return ring_all_gather(x, block, rounds, ranks)


def doubling_all_reduce(x, rounds):
    """Recursive doubling (TRG 2005): lg p rounds, each swapping the whole buffer with r XOR 2^k and
    adding it: latency-optimal, n lg p bytes per rank (p = 2^k; folded otherwise)."""
    return recursive.doubling_all_reduce(x, rounds, *_rank_and_size())


def rabenseifner_all_reduce(x, rounds):
    """Rabenseifner (TRG 2005): recursive-halving reduce-scatter, then recursive-doubling all-gather:
    2 lg p rounds and the ring's 2(p-1)/p * n bytes (p = 2^k; folded otherwise)."""
    return recursive.rabenseifner_all_reduce(x, rounds, *_rank_and_size())


def pairwise_all_to_all(out, x, rounds):
    """Pairwise exchange (TRG 2005): in round s = 1..p-1 rank r sends block (r+s) mod p
    to rank r+s and receives block r from rank r-s; p-1 rounds, (p-1)/p of ``x`` sent."""
    p, r = dist.get_world_size(), dist.get_rank()
    src, dst = x.view(-1).chunk(p), out.view(-1).chunk(p)
    dst[r].copy_(src[r])
    for s in range(1, p):
        rounds.exchange(sends=[(src[(r + s) % p], (r + s) % p)], recvs=[(dst[(r - s) % p], (r - s) % p)])
    return out


HAND = {("broadcast", "tree"): tree_broadcast, ("reduce", "tree"): tree_reduce,
        ("all_gather", "ring"): ring_all_gather, ("all_gather", "recursive_doubling"): doubling_all_gather,
        ("reduce_scatter", "ring"): ring_reduce_scatter,
        ("reduce_scatter", "recursive_halving"): halving_reduce_scatter,
        ("all_reduce", "ring"): ring_all_reduce, ("all_reduce", "recursive_doubling"): doubling_all_reduce,
        ("all_reduce", "rabenseifner"): rabenseifner_all_reduce,
        ("all_to_all", "pairwise"): pairwise_all_to_all}
