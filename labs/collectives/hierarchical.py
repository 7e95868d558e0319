"""Chapter 10: a two-level all-reduce by hand on a simulated grid of nodes, counted per link tier.

Ranks r = 0..p-1 sit on k = p/g simulated nodes of g (node = r // g, local rank = r % g), as
chapter 11 lays out a cluster. A flat ring over all p ranks sends each rank 2(p-1)/p of the buffer
to its ring successor; the g-1 successors inside a node are fast links, but the last local rank of
every node sends its whole 2(p-1)/p share across the slow tier. The two-level all-reduce (the
scheme of Horovod's hierarchical all-reduce, horovod/common/ops/nccl_operations.cc: "NCCL
ReduceScatter - Parallelized MPI Allreduce - NCCL Allgather") keeps most bytes inside nodes:

    1. reduce-scatter inside the node (ring over its g ranks): local rank j holds block j of the
       node's sum, n/g bytes                                  intra: (g-1)/g n per rank
    2. all-reduce of that block among the k ranks with local rank j, one per node (ring)
                                                              inter: 2(k-1)/k n/g per rank
    3. all-gather inside the node (ring)                      intra: (g-1)/g n per rank

Every rank uses the slow tier, each for 1/g of the flat ring's busiest rank's share, in parallel.
The three phases are chapter 10's ring functions over explicit lists of global ranks (no process
groups), every message counted by `labs.measure.comm` with its destination, so bytes per tier are
counted, not derived: a message is inter-node when its destination's node differs from the sender's.

    python -m labs.collectives.hierarchical --world-size 4 --gpus-per-node 2 --json
"""
import torch
import torch.distributed as dist

from labs.collectives import algorithms
from labs.collectives.recursive import Rounds
from labs.launcher import launch, preflight
from labs.measure import comm


def check(world_size, gpus_per_node, numel):
    """Refuse, in one sentence, a grid or a buffer the two levels cannot split evenly."""
    preflight.check_world_size(world_size)
    if gpus_per_node < 1 or world_size % gpus_per_node:
        raise ValueError(f"{world_size} ranks do not fill nodes of {gpus_per_node}: choose a world size "
                         f"that is a multiple of gpus_per_node.")
    if numel % world_size:
        raise ValueError(f"the buffer of {numel} elements must split into {world_size} equal blocks: make "
                         f"it a multiple of {world_size}.")


def _tiers(tally, g):
    """Counted bytes this rank sent inside its node and to other nodes, from each message's destination."""
    node = dist.get_rank() // g
    intra = sum(b for dst, b in tally.sent_to.items() if dst // g == node)
    return {"intra": intra, "inter": tally.bytes_sent - intra}


def hierarchical_all_reduce(x, rounds, g):
    """In place: reduce-scatter in the node, all-reduce across nodes, all-gather in the node."""
    p, r = dist.get_world_size(), dist.get_rank()
    node, local = divmod(r, g)
    in_node = list(range(node * g, node * g + g))     # this node's ranks, ring order
    peers = list(range(local, p, g))                  # the same local rank on every node
    block = torch.empty(x.numel() // g, dtype=x.dtype, device=x.device)
    algorithms.ring_reduce_scatter(block, x, rounds, in_node)   # (n/g,) block `local` of the node's sum
    algorithms.ring_all_reduce(block, rounds, peers)            # block `local` of the global sum
    return algorithms.ring_all_gather(x, block, rounds, in_node)


def rank_compare(rank, world_size, g, numel):
    """One rank: the two-level all-reduce and the flat ring on the same input, against the library's.

    The input is small integers in fp32, so every partial sum is exact and both must equal the
    library's all-reduce bit for bit. Bytes per tier and rounds of each algorithm are counted."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(-8, 9, (numel,), generator=gen).float().to(launch.device())
    library = x.clone()
    dist.all_reduce(library)
    out = {}
    for name, run in (("hierarchical", lambda t, rd: hierarchical_all_reduce(t, rd, g)),
                      ("flat_ring", algorithms.ring_all_reduce)):
        mine, rounds = x.clone(), Rounds()
        with comm.counting() as tally:
            run(mine, rounds)
        out[name] = {**_tiers(tally, g), "rounds": rounds.count, "schedule": rounds.log,
                     "equals_library": torch.equal(mine, library)}   # integer sums: exact in any order
    return out


def formula(world_size, g, nbytes):
    """Per rank: (intra, inter) bytes of each algorithm. Flat ring: rank r sends 2(p-1)/p n to r + 1,
    across nodes when r is its node's last rank; two-level: 2(g-1)/g n inside, 2(k-1)/k n/g across."""
    p, k = world_size, world_size // g
    share = 2 * (p - 1) * nbytes // p
    flat = [(0, share) if k > 1 and r % g == g - 1 else (share, 0) for r in range(p)]
    two_level = (2 * (g - 1) * nbytes // g, 2 * (k - 1) * (nbytes // g) // k)
    return {"flat_ring": flat, "hierarchical": [two_level] * p,
            "rounds": {"flat_ring": 2 * (p - 1), "hierarchical": 2 * (g - 1) + 2 * (k - 1)}}


def compare(world_size=4, gpus_per_node=2, numel=1200, timeout=120.0):
    """Spawn the grid; per algorithm, per rank counted intra/inter bytes and rounds, equality with the
    library's all-reduce, and the formula beside them."""
    check(world_size, gpus_per_node, numel)
    ranks = launch.spawn(rank_compare, world_size, gpus_per_node, numel, timeout=timeout)
    rows = {name: {"intra": [r[name]["intra"] for r in ranks], "inter": [r[name]["inter"] for r in ranks],
                   "rounds": max(r[name]["rounds"] for r in ranks),
                   "schedule": [r[name]["schedule"] for r in ranks],
                   "equals_library": all(r[name]["equals_library"] for r in ranks)}
            for name in ("hierarchical", "flat_ring")}
    return {"world_size": world_size, "gpus_per_node": gpus_per_node, "nbytes": 4 * numel, **rows,
            "formula": formula(world_size, gpus_per_node, 4 * numel)}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("A two-level all-reduce (reduce-scatter in the node, all-reduce across, all-gather in the "
                   "node) beside a flat ring, bytes counted per link tier.", world_size_default=4)
    p.add_argument("--gpus-per-node", type=cli.positive_int, default=2)
    p.add_argument("--numel", type=cli.positive_int, default=1200, help="fp32 elements of the buffer")
    args = cli.parse(p, argv)
    check(args.world_size, args.gpus_per_node, args.numel)
    r = compare(args.world_size, args.gpus_per_node, args.numel, timeout=args.timeout)
    lines = [f"{name}: rounds {r[name]['rounds']}, inter-node bytes per rank {r[name]['inter']}, "
             f"intra-node {r[name]['intra']}, equals the library's: {r[name]['equals_library']}"
             for name in ("hierarchical", "flat_ring")]
    cli.report(r, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
