"""Chapter 10: every collective built from point-to-point messages, one function per algorithm.

Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 19(1), 2005): broadcast and reduce as binomial trees, all-gather and reduce-scatter as a
ring or by recursive doubling and halving, all-reduce as a ring, by recursive doubling or as
Rabenseifner's halving reduce-scatter then doubling all-gather, all-to-all by pairwise exchange.
The ring halves are chapter 2's (`labs.data_parallel.hand_ring`); the recursive ones, and the fold
that lets them run on any p, are `labs.collectives.recursive`. Each function counts the exchanges
this rank takes part in (``rounds``); every message goes through `labs.measure.comm`. `HAND`
names them by (op, algorithm); `labs.collectives.toolkit` checks each against its cost formula
and the library's collective.
"""
import torch
import torch.distributed as dist

from labs.collectives import recursive
from labs.data_parallel import hand_ring

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


def ring_all_gather(out, shard, rounds):
    """Chapter 2's ring: p-1 rounds of one shard each."""
    rounds.count += dist.get_world_size() - 1
    return hand_ring.ring_all_gather_into(out, shard)


def ring_reduce_scatter(out, x, rounds):
    """Chapter 2's ring: p-1 rounds; rank r ends with block r of the sum."""
    p = dist.get_world_size()
    rounds.count += p - 1
    return hand_ring.ring_reduce_scatter(out, list(x.view(-1).chunk(p)))


def doubling_all_gather(out, shard, rounds):
    """Recursive doubling (TRG 2005): in round k a rank swaps the blocks it holds with r XOR 2^k;
    lg p rounds and (p-1)/p of ``out`` sent when p = 2^k, folded otherwise (`labs.collectives.recursive`)."""
    return recursive.doubling_all_gather(out, shard, rounds, *_rank_and_size())


def halving_reduce_scatter(out, x, rounds):
    """Recursive halving (TRG 2005): in round k a rank sends the half of its range that r XOR 2^k
    keeps and adds the partner's copy of its own half; rank r ends with block r of the sum."""
    return recursive.halving_reduce_scatter(out, x, rounds, *_rank_and_size())


def ring_all_reduce(x, rounds):
    """Chapter 2's ring: reduce-scatter then all-gather, 2(p-1) rounds."""
    rounds.count += 2 * (dist.get_world_size() - 1)
    return hand_ring.ring_allreduce(x)


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
        ("all_reduce", "rabenseifner"): rabenseifner_all_reduce, ("all_to_all", "pairwise"): pairwise_all_to_all}
