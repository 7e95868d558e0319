"""Chapter 11: the bytes that cross a simulated node boundary, counted message by message.

The calculator (`labs.hardware.placement`) says which groups straddle nodes and how many bytes
their rings move. Here a real job checks it: the ranks are laid out as the calculator lays them
out, on simulated nodes of g ranks (node = rank // g), the groups come from the layout's torch
DeviceMesh (`labs.groups.device_mesh`: `init_device_mesh`, one named dimension per axis, slowest first) and
are checked equal to the calculator's, and each rank runs one hand ring all-reduce (chapter 2's,
`hand_ring.ring_allreduce`) per TP, CP and DP group and one send to its next pipeline stage.
`labs.measure.comm` records every
message with its destination; a message crosses when its destination's node is not the sender's.
`crossing_formula` predicts the same total from the groups alone (a ring crosses a boundary once
per pair of ring neighbours on different nodes), so the two disagree if a message leaves its
group or its group sits elsewhere; a ring that sent to its predecessor instead of its successor
crosses the same boundaries and agrees. The pipeline here is a plain chain (no wrap from the last
stage to the first, which the calculator's interleaved Llama 3 counts include).

    python -m labs.hardware.boundary --world-size 4 --gpus-per-node 3 --tp 2 --dp 2 --json
"""
import torch
import torch.distributed as dist

from labs.data_parallel.hand_ring import ring_allreduce
from labs.dims import ORDER, ParallelDims
from labs.groups import device_mesh
from labs.hardware.placement import LLAMA3_ORDER, Placement
from labs.launcher import launch
from labs.formulas import costs
from labs.measure import comm

AXES = LLAMA3_ORDER   # the four axes a run here has (ep = 1)


def crossing_formula(p, payloads):
    """Bytes that cross a node boundary in one call per axis (all ranks together, ring order).

    A ring over a group sends each rank's per-call bytes to its successor; every successor on
    another node is one crossing. A PP send crosses when the two stages sit on different nodes."""
    total = {}
    for axis, (kind, m) in payloads.items():
        n, out = p.dims.size(axis), 0
        for ranks in p.dims.groups(axis):
            nodes = [r // p.gpus_per_node for r in ranks]
            if kind == "send":
                out += m * sum(a != b for a, b in zip(nodes, nodes[1:]))
            else:
                out += costs.sent(kind, m, n) * sum(nodes[i] != nodes[(i + 1) % n] for i in range(n))
        total[axis] = out
    return total


def simulate(rank, world_size, p, numel):
    """One rank: a ring all-reduce per TP, CP and DP group and a PP send, over the DeviceMesh's
    groups; per axis the counted bytes this rank sent to ranks on other simulated nodes, summed over
    its messages by destination (0 for an axis of degree 1, which has no dimension in the mesh and
    no message to send). ``numel``: fp32 elements per call, one number or {axis: numel}."""
    sizes = numel if isinstance(numel, dict) else dict.fromkeys(AXES, numel)
    node, grid = rank // p.gpus_per_node, device_mesh(p.dims)
    crossed = {}
    for axis in AXES:
        if axis not in grid.mesh_dim_names:
            crossed[axis] = 0
            continue
        my_group = grid.get_group(axis)
        mine = dist.get_process_group_ranks(my_group)
        assert mine in p.dims.groups(axis), f"the mesh's {axis} group {mine} is not the calculator's"
        i, n = mine.index(rank), len(mine)
        x = torch.full((sizes[axis],), float(rank), device=launch.device())
        with comm.counting() as tally:
            if axis == "pp":
                if i + 1 < n:
                    comm.send(x, mine[i + 1])
                if i > 0:
                    comm.recv(x, mine[i - 1])
            else:
                ring_allreduce(x, my_group)
                assert x[0].item() == sum(mine), "the group's sum"
        crossed[axis] = sum(b for dst, b in tally.sent_to.items() if dst // p.gpus_per_node != node)
    return crossed


def count(p, numel, timeout=120.0):
    """Spawn ``p``'s world; per axis, the counted crossing bytes of all ranks and the formula's."""
    sizes = numel if isinstance(numel, dict) else dict.fromkeys(AXES, numel)
    ranks = launch.spawn(simulate, p.dims.world_size, p, sizes, timeout=timeout)
    payloads = {a: ("send" if a == "pp" else "all_reduce", 4 * sizes[a]) for a in AXES}
    return {"counted": {a: sum(r[a] for r in ranks) for a in AXES},
            "formula": {a: int(v) for a, v in crossing_formula(p, payloads).items()},
            "group_nodes": {a: p.group_nodes(a) for a in AXES}}


def main(argv=None):
    from labs.launcher import cli
    ap = cli.parser("Bytes crossing a simulated node boundary, counted by each message's destination, "
                    "beside the calculator's formula.", world_size_default=None)
    for axis in AXES:
        ap.add_argument(f"--{axis}", type=cli.positive_int, default=1)
    ap.add_argument("--gpus-per-node", type=cli.positive_int, default=2)
    ap.add_argument("--numel", type=cli.positive_int, default=1020, help="fp32 elements per call")
    ap.add_argument("--reversed", action="store_true", help="order [DP, PP, CP, TP] instead of Llama 3's")
    args = cli.parse(ap, argv)
    order = tuple(reversed(ORDER)) if args.reversed else ORDER
    dims = ParallelDims(**{a: getattr(args, a) for a in AXES}, order=order)
    layout = Placement(dims, gpus_per_node=args.gpus_per_node)
    if args.world_size not in (None, dims.world_size):
        raise ValueError(f"--world-size {args.world_size} is not tp*cp*pp*dp = {dims.world_size}; "
                         "drop --world-size or change the degrees.")
    r = count(layout, args.numel, timeout=args.timeout)
    cli.report(r, args, f"counted {r['counted']}\nformula {r['formula']}\nnodes per group {r['group_nodes']}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
