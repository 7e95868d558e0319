"""Chapters 10, 11 and 14: how long one collective takes on a group: alpha per call from NCCL's tuning
model, bytes over the group's link tier. Chapters 2, 3 and 4: `ring_bandwidth`, a ring's W per GPU
inside a node or across nodes.

    T = alpha(op, n, nodes) + B / BW_tier

B is the formula bytes one rank sends (`labs.formulas.costs`, the ring factors); BW_tier the link a
group sits on by chapter 11's group-by-group rule (`ParallelDims.group_nodes`); alpha is chapter 10's
latency term, with NCCL's own constants (`labs.formulas.collectives`, read from NVIDIA/nccl
src/graph/tuning.cc at 5067397c: ``baseLatencies`` and ``hwLatencies``) for the Simple protocol that
large messages use, as ``ncclTopoTuneModel`` adds them up:

    ring (all-gather, reduce-scatter: n-1 steps; all-reduce: 2(n-1)):
        base + (steps - inter) max(lat_intra, 3 netOverhead) + inter lat_net
        with inter = nodes - 1 (all-reduce: 2(nodes - 1)) steps crossing the network
    tree (all-reduce across nodes): base + 2((n/nodes - 1) lat_intra_tree + log2(nodes) lat_net)

base = 8.4 us (Ring and Tree, Simple), lat_intra = 3.4 us on NVLink and 5.7 us on PCIe (Ring, Simple),
4.0 us (Tree, Simple), lat_net = 14 us, netOverhead = 1 us (``getNetOverhead``, x3 for Simple).
NCCL picks the faster of ring and tree for an all-reduce; the planner does the same with alpha (the
two move nearly the same bytes). A point-to-point send and an all-to-all (NCCL's grouped sends to
every peer at once) are charged base + one step of their tier. Left out: NCCL's protocol switch
to LL/LL128 for small messages (lower alpha, lower bandwidth) and its bandwidth corrections.
"""
import functools
import math

from labs.formulas import collectives
from labs.formulas import costs

US = 1e-6
SIMPLE = collectives.PROTOCOLS.index("Simple")
BASE = collectives.BASE_LATENCY_US["Ring"][SIMPLE] * US            # 8.4 us (Tree's is the same)
# tuning.cc hwLatencies, Simple: NVLink and NET rows are chapter 10's table; PCI's Ring/Tree Simple
# entries (5.7 and 4.0 us) are the same file's PCI row
RING_STEP = {"NVLINK": collectives.HW_LATENCY_US["NVLINK"]["Ring"][SIMPLE] * US, "PCI": 5.7 * US,
             "NET": collectives.HW_LATENCY_US["NET"]["Ring"][SIMPLE] * US}
TREE_STEP = {"NVLINK": collectives.HW_LATENCY_US["NVLINK"]["Tree"][SIMPLE] * US, "PCI": 4.0 * US,
             "NET": collectives.HW_LATENCY_US["NET"]["Tree"][SIMPLE] * US}
NET_OVERHEAD = 3 * 1.0 * US     # getNetOverhead() on x86, times 3 for Simple


@functools.lru_cache(maxsize=None)
def alpha(op, n, nodes, link="NVLINK"):
    """Seconds of latency in one call of ``op`` on n ranks over ``nodes`` nodes (see the docstring)."""
    if n <= 1:
        return 0.0
    if op in ("send", "all_to_all"):
        return BASE + (RING_STEP["NET"] if nodes > 1 else RING_STEP[link])
    steps, inter = (2 * (n - 1), 2 * (nodes - 1)) if op == "all_reduce" else (n - 1, nodes - 1)
    intra = max(RING_STEP[link], NET_OVERHEAD) if nodes > 1 else RING_STEP[link]
    ring = BASE + (steps - inter) * intra + inter * RING_STEP["NET"]
    if op != "all_reduce" or nodes == 1:
        return ring
    tree = BASE + 2 * ((n / nodes - 1) * TREE_STEP[link] + math.floor(math.log2(nodes)) * TREE_STEP["NET"])
    return min(ring, tree)


def collective_time(op, payload, n, nodes, cluster):
    """alpha + formula bytes (`costs.factor` of the payload) over the group's link, for one call on n
    ranks over ``nodes`` nodes: the intra-node link on one node, the network port otherwise (a ring is
    as slow as its slowest hop), except an all-to-all, whose messages to the peers on the rank's own
    node go over the intra-node link while the rest cross the network, at the same time."""
    if n <= 1:
        return 0.0
    a, sent = alpha(op, n, nodes, cluster.link), _factor(op, n) * payload
    if nodes == 1:
        return a + sent / cluster.intra_bw
    if op != "all_to_all":
        return a + sent / cluster.inter_bw
    near = n // nodes - 1                     # peers on the rank's own node, of the n - 1
    return a + max(sent * (n - 1 - near) / (n - 1) / cluster.inter_bw, sent * near / (n - 1)
                   / cluster.intra_bw)


@functools.lru_cache(maxsize=None)
def _factor(op, n):
    return float(costs.factor(op, n))


@functools.lru_cache(maxsize=None)
def atom_nodes(stride, n, gpus_per_node):
    """Nodes one group of n ranks spaced ``stride`` apart touches, at most, on nodes of G GPUs (ranks
    filling nodes in order): ParallelDims.group_nodes in closed form where the grid aligns with the
    nodes, and that rule itself on a small grid of the same strides where it does not."""
    G = gpus_per_node
    if n == 1 or G % (stride * n) == 0:
        return 1
    if stride % G == 0:
        return n
    if G % stride == 0 and (stride * n) % G == 0:
        return stride * n // G
    from labs.dims import ParallelDims
    world = math.lcm(G, stride * n)
    probe = ParallelDims(tp=stride, pp=n, dp=world // (stride * n))
    return max(probe.group_nodes("pp", G))


def group_nodes(dims, axis, gpus_per_node):
    """Nodes a group of ``axis`` (a name or a tuple of names, as `ParallelDims.size` takes them)
    touches: its grid atoms, merged where they are adjacent (only atoms of size 1 between them), each
    block priced by `atom_nodes`, multiplied. Folded experts (`ParallelDims.fold_ep`) take no atom of the
    grid: their groups are counted one by one."""
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    if dims.fold_ep and {"ep", "edp"} & set(names):
        if len(names) > 1:
            raise ValueError(f"folded experts have a grid of their own: {axis!r} cannot combine ep or edp "
                             "with the other axes; ask for 'ep' or 'edp' alone.")
        return max(dims.group_nodes(names[0], gpus_per_node))
    chosen = set().union(*(dims.GROUPS[a] for a in names))
    blocks, stride, last = [], 1, None          # [stride, size] of each run of chosen atoms
    for a, size in dims.atoms():
        if a in chosen and size > 1:
            if last is not None and last == stride:       # continues the previous block
                blocks[-1][1] *= size
            else:
                blocks.append([stride, size])
            last = stride * size
        elif size > 1:
            last = None
        stride *= size
    nodes = 1
    for s, n in blocks:
        nodes *= atom_nodes(s, n, gpus_per_node)
    return nodes


def ring_bandwidth(nodes, group_gpus_per_node, gpus_per_node=8):
    """W, bytes/s per direction per GPU, for a ring over ``nodes`` nodes with ``group_gpus_per_node``
    of its GPUs on each (chapters 2, 3 and 4; ranks placed node by node).

    On one node the ring runs on NVLink. Across nodes the ring crosses each node's boundary once per
    ring, and NCCL runs one ring per channel and spreads the channels over the node's NICs (rails,
    one NDR NIC per GPU, chapter 11): the ring's data leaves a node through all of the group's NICs
    at once. W is then min(NVLink, NICs in use x 50 GB/s): 400 GB/s for full 8-GPU H100 nodes (Austin
    et al. 2025, "How to Scale Your Model", Part 12 "How to Think About GPUs": an H100 node's egress,
    400e9, the figure they use beyond a node), and one NIC's 50 GB/s only when each rank of the ring
    sits on a node of its own."""
    if nodes < 1 or not 1 <= group_gpus_per_node <= gpus_per_node:
        raise ValueError(f"need nodes >= 1 and 1 <= GPUs of the group per node <= {gpus_per_node}, got "
                         f"nodes={nodes}, {group_gpus_per_node} per node.")
    nvlink, nic = collectives.NVLINK4_BPS, collectives.NDR_IB_BPS
    return nvlink if nodes == 1 else min(nvlink, group_gpus_per_node * nic)
