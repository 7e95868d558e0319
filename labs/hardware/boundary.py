"""Chapter 11: the bytes that cross a simulated node boundary, counted message by message.

The calculator (`labs.hardware.placement`) says which groups straddle nodes and how many bytes
their rings move. Here a real job checks it: the ranks are laid out as the calculator lays them
out, on simulated nodes of g ranks (node = rank // g), the groups come from a torch DeviceMesh
(`init_device_mesh`, one named dimension per axis, slowest first) and are checked equal to the
calculator's, and each rank runs one hand ring all-reduce (chapter 2's, `hand_ring.ring_allreduce`)
per TP, CP and DP group and one send to its next pipeline stage. `labs.measure.comm` records every
message with its destination; a message crosses when its destination's node is not the sender's.
`crossing_formula` predicts the same total from the groups alone (a ring crosses a boundary once
per pair of ring neighbours on different nodes), so the two can disagree if the messages went
anywhere else.

    python -m labs.hardware.boundary --world-size 4 --gpus-per-node 3 --tp 2 --dp 2 --json
"""
import torch
import torch.distributed as dist

from labs.data_parallel.hand_ring import ring_allreduce
from labs.hardware.placement import ORDER, Placement, bytes_per_call
from labs.launcher import launch
from labs.measure import comm


def crossing_formula(p, payloads):
    """Bytes that cross a node boundary in one call per axis (all ranks together, ring order).

    A ring over a group sends each rank's per-call bytes to its successor; every successor on
    another node is one crossing. A PP send crosses when the two stages sit on different nodes."""
    total = {}
    for axis, (kind, m) in payloads.items():
        n, out = p.degrees.get(axis, 1), 0
        for ranks in p.groups(axis):
            nodes = [r // p.gpus_per_node for r in ranks]
            if kind == "send":
                out += m * sum(a != b for a, b in zip(nodes, nodes[1:]))
            else:
                out += bytes_per_call(kind, m, n) * sum(nodes[i] != nodes[(i + 1) % n] for i in range(n))
        total[axis] = out
    return total


def mesh(p):
    """The simulated cluster as a torch DeviceMesh: dims slowest first (``order`` reversed), named
    after the axes, so mesh.get_group("tp") is this rank's TP group (the same grid as `groups`)."""
    from torch.distributed.device_mesh import init_device_mesh
    names = tuple(reversed(p.order))
    return init_device_mesh(launch.device().type, tuple(p.degrees.get(a, 1) for a in names),
                            mesh_dim_names=names)


def simulate(rank, world_size, p, numel):
    """One rank: a ring all-reduce per TP, CP and DP group and a PP send, over the DeviceMesh's
    groups; per axis the counted bytes this rank sent to ranks on other simulated nodes, summed over
    its messages by destination. ``numel``: fp32 elements per call, one number or {axis: numel}."""
    sizes = numel if isinstance(numel, dict) else dict.fromkeys(ORDER, numel)
    node, grid = rank // p.gpus_per_node, mesh(p)
    crossed = {}
    for axis in ORDER:
        my_group = grid.get_group(axis)
        mine = dist.get_process_group_ranks(my_group)
        assert mine in p.groups(axis), f"the mesh's {axis} group {mine} is not the calculator's"
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
    sizes = numel if isinstance(numel, dict) else dict.fromkeys(ORDER, numel)
    ranks = launch.spawn(simulate, p.world_size, p, sizes, timeout=timeout)
    payloads = {a: ("send" if a == "pp" else "all_reduce", 4 * sizes[a]) for a in ORDER}
    return {"counted": {a: sum(r[a] for r in ranks) for a in ORDER},
            "formula": {a: int(v) for a, v in crossing_formula(p, payloads).items()},
            "group_nodes": {a: p.group_nodes(a) for a in ORDER}}


def main(argv=None):
    from labs.launcher import cli
    ap = cli.parser("Bytes crossing a simulated node boundary, counted by each message's destination, "
                    "beside the calculator's formula.", world_size_default=None)
    for axis in ORDER:
        ap.add_argument(f"--{axis}", type=cli.positive_int, default=1)
    ap.add_argument("--gpus-per-node", type=cli.positive_int, default=2)
    ap.add_argument("--numel", type=cli.positive_int, default=1020, help="fp32 elements per call")
    ap.add_argument("--reversed", action="store_true", help="order [DP, PP, CP, TP] instead of Llama 3's")
    args = cli.parse(ap, argv)
    layout = Placement({a: getattr(args, a) for a in ORDER}, gpus_per_node=args.gpus_per_node,
                       order=tuple(reversed(ORDER)) if args.reversed else ORDER)
    if args.world_size not in (None, layout.world_size):
        raise ValueError(f"--world-size {args.world_size} is not tp*cp*pp*dp = {layout.world_size}; "
                         "drop --world-size or change the degrees.")
    r = count(layout, args.numel, timeout=args.timeout)
    cli.report(r, args, f"counted {r['counted']}\nformula {r['formula']}\nnodes per group {r['group_nodes']}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
