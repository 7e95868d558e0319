"""Chapter 11: which parallel group sits on which link tier, and the bytes each tier carries.

Ranks are laid out with the first axis of ``order`` fastest-varying; Llama 3 orders its groups
[TP, CP, PP, DP] so that the chattiest group (TP) is innermost, on NVLink inside a node
(Llama 3 Herd of Models, Dubey et al. 2024, arXiv 2407.21783, section 3.3.2). A group of n ranks
with stride ``stride`` (the product of the faster axes' degrees) stays inside a node of g GPUs
exactly when stride * n <= g.

Bytes per rank per step, bf16 (2 bytes), ring collectives (2(n-1)/n * M for an all-reduce of M
bytes, (n-1)/n * M for an all-gather of the full M; Patarasuk & Yuan 2009):
- TP (Megatron, Shoeybi et al. 2019, section 3): 4 all-reduces of b*(s/cp)*h per layer per
  micro-batch (2 forward, 2 backward).
- CP (all-gather of K and V, Llama 3 section 3.3.2): forward all-gather and backward
  reduce-scatter of 2*b*s*h_kv/tp per layer per micro-batch.
- PP: one activation b*(s/cp)*h/tp forward and one gradient back per micro-batch and boundary.
- DP: one all-reduce of the gradients, params/(tp*pp) per rank, per step.
- EP (formula only, not simulated): dispatch and combine, forward and backward, 4 all-to-alls of
  k*b*s*h/(tp*cp) per MoE layer, each sending (n-1)/n of it.
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labs.measure import comm
from labs.launcher import launch
from labs.data_parallel.hand_ring import ring_allreduce

BF16 = 2
ORDER = ("tp", "cp", "pp", "dp")  # Llama 3's order, fastest-varying first
# Per direction, in bytes per second; sources in book/11-hardware.md's table.
NVLINK4_BPS = 18 * 25e9     # H100 SXM: 18 links x 25 GB/s = 450 GB/s per direction
NDR_IB_BPS = 400e9 / 8      # NDR InfiniBand: 400 Gb/s per port = 50 GB/s
PCIE5_X16_BPS = 64e9        # PCIe 5.0 x16: 32 GT/s x 16 lanes, ~64 GB/s per direction


@dataclass(frozen=True)
class Model:
    """Shapes that set the traffic: hidden h, KV width h_kv, layers, sequence s, micro-batch b."""
    hidden: int
    kv_hidden: int
    layers: int
    params: int
    seq: int
    micro_batch: int = 1
    micro_batches: int = 1
    moe_layers: int = 0
    top_k: int = 1


LLAMA3_405B = Model(hidden=16384, kv_hidden=8 * 128, layers=126, params=405_000_000_000, seq=8192,
                    micro_batches=16)  # Llama 3 Table 3 shapes; 16 micro-batches is illustrative


@dataclass(frozen=True)
class Placement:
    degrees: dict          # {"tp": 8, "cp": 1, "pp": 16, "dp": 128}
    gpus_per_node: int = 8
    order: tuple = ORDER
    tiers: dict = field(default_factory=lambda: {"intra": NVLINK4_BPS, "inter": NDR_IB_BPS})

    def __post_init__(self):
        for axis in ORDER:
            d = self.degrees.get(axis, 1)
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(f"degree {axis} must be a positive integer, got {d!r}.")
        if sorted(self.order) != sorted(ORDER):
            raise ValueError(f"order must be a permutation of {ORDER}, got {self.order}.")
        if self.world_size % self.gpus_per_node and self.gpus_per_node % self.world_size:
            raise ValueError(f"{self.world_size} ranks do not fill nodes of {self.gpus_per_node}; "
                             "choose degrees whose product is a multiple of gpus_per_node.")

    @property
    def world_size(self):
        out = 1
        for axis in ORDER:
            out *= self.degrees.get(axis, 1)
        return out

    def stride(self, axis):
        """Distance in global rank between neighbours of ``axis``: the product of faster axes."""
        out = 1
        for a in self.order[:self.order.index(axis)]:
            out *= self.degrees.get(a, 1)
        return out

    def nodes_spanned(self, axis):
        """How many nodes one group of ``axis`` touches (1: all on the fast tier)."""
        span = self.stride(axis) * self.degrees.get(axis, 1)
        return max(1, -(-span // self.gpus_per_node)) if self.degrees.get(axis, 1) > 1 else 1

    def tier(self, axis):
        return "intra" if self.nodes_spanned(axis) == 1 else "inter"

    def grid(self):
        """Rank grid with dims in ``order`` reversed (slowest first), so order[0] is contiguous."""
        shape = [self.degrees.get(a, 1) for a in reversed(self.order)]
        return torch.arange(self.world_size).view(shape)

    def groups(self, axis):
        dim = list(reversed(self.order)).index(axis)
        moved = self.grid().movedim(dim, -1)
        return moved.reshape(-1, moved.shape[-1]).tolist()


def tier_of(stride, n, gpus_per_node):
    """The tier of a group of n ranks whose faster axes multiply to ``stride``: "intra" exactly
    when stride * n <= gpus_per_node (the rule `Placement.nodes_spanned` applies per axis)."""
    return "intra" if n == 1 or stride * n <= gpus_per_node else "inter"


def collectives(model, p):
    """Per axis: (kind, payload bytes M per call, calls per rank per step), from the shapes."""
    d = {a: p.degrees.get(a, 1) for a in ORDER}
    local_layers = model.layers // d["pp"]
    act = model.micro_batch * (model.seq // d["cp"]) * model.hidden * BF16  # (b, s/cp, h)
    kv = 2 * model.micro_batch * model.seq * model.kv_hidden // d["tp"] * BF16  # K and V, full s
    out = {"tp": ("all_reduce", act, 4 * local_layers * model.micro_batches),
           "cp": ("all_gather", kv, 2 * local_layers * model.micro_batches),
           "pp": ("send", act // d["tp"], 2 * model.micro_batches),
           "dp": ("all_reduce", model.params // (d["tp"] * d["pp"]) * BF16, 1)}
    if model.moe_layers:
        tokens = model.top_k * model.micro_batch * model.seq * model.hidden * BF16 // (d["tp"] * d["cp"])
        out["ep"] = ("all_to_all", tokens, 4 * model.moe_layers // d["pp"] * model.micro_batches)
    return out


def bytes_per_call(kind, m, n):
    """Bytes one rank sends for one call of ``kind`` with payload M on a group of n (ring)."""
    if n == 1:
        return 0
    return {"all_reduce": 2 * (n - 1) * m / n, "all_gather": (n - 1) * m / n,
            "all_to_all": (n - 1) * m / n, "send": m}[kind]


def plan(model, p, ep=1):
    """Bytes per rank per step on each axis, its tier, and the time at that tier's bandwidth."""
    rows = {}
    for axis, (kind, m, calls) in collectives(model, p).items():
        n = ep if axis == "ep" else p.degrees.get(axis, 1)
        tier = "intra" if axis == "ep" and ep <= p.gpus_per_node else p.tier(axis) if axis != "ep" else "inter"
        sent = bytes_per_call(kind, m, n) * calls
        rows[axis] = {"degree": n, "kind": kind, "payload_bytes": m, "calls": calls, "tier": tier,
                      "bytes_per_rank": sent, "seconds": sent / p.tiers[tier]}
    return rows


def crossing_formula(p, payloads):
    """Bytes that cross a node boundary in one call per axis (all ranks together, ring order).

    A ring over a group that spans k > 1 nodes (contiguous blocks) crosses k links, each carrying
    the per-rank ring bytes; a PP send crosses when the two stages sit on different nodes.
    """
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
    """Run one ring all-reduce (TP, CP, DP) and one PP send per axis over the groups of ``p``'s
    DeviceMesh, counting the bytes this rank sends to a rank on another simulated node
    (node = rank // gpus_per_node). ``numel``: fp32 elements per call, one number for every axis
    or a dict {axis: numel}. Also checks that the mesh's groups are the calculator's.
    """
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
                dst = mine[i + 1] if i + 1 < n else None
            else:
                ring_allreduce(x, my_group)
                assert x[0].item() == sum(mine), "the group's sum"
                dst = mine[(i + 1) % n] if n > 1 else None
        crosses = dst is not None and dst // p.gpus_per_node != node
        crossed[axis] = tally.bytes_sent if crosses else 0
    return crossed


def _tp_traffic(order):
    layout = Placement({"tp": 8, "cp": 1, "pp": 16, "dp": 128}, order=order)
    return plan(LLAMA3_405B, layout)["tp"]


ANSWERS = {  # chapter 11's exercises, computed by the calculator above
    "11.1": lambda: _tp_traffic(ORDER)["bytes_per_rank"] / 1e9,          # GB per rank per step
    "11.2": lambda: _tp_traffic(tuple(reversed(ORDER)))["seconds"],      # s, TP over NDR
}


def check(question, answer, rel=0.01):
    from labs.measure import exercises
    return exercises.check(ANSWERS, question, answer, rel)


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Bytes per step and time on each link tier for a Llama 3 405B layout "
                   "(formula values at data-sheet speeds).", world_size_default=None)
    for axis, default in (("tp", 8), ("cp", 1), ("pp", 16), ("dp", 128)):
        p.add_argument(f"--{axis}", type=cli.positive_int, default=default)
    p.add_argument("--gpus-per-node", type=cli.positive_int, default=8)
    p.add_argument("--reversed", action="store_true", help="order [DP, PP, CP, TP] instead of Llama 3's")
    args = cli.parse(p, argv)
    degrees = {a: getattr(args, a) for a in ORDER}
    order = tuple(reversed(ORDER)) if args.reversed else ORDER
    layout = Placement(degrees, gpus_per_node=args.gpus_per_node, order=order)
    if args.world_size not in (None, layout.world_size):
        raise ValueError(f"--world-size {args.world_size} is not tp*cp*pp*dp = {layout.world_size}; "
                         "drop --world-size or change the degrees.")
    rows = plan(LLAMA3_405B, layout)
    lines = [f"{a}: {r['tier']} {r['bytes_per_rank'] / 1e9:.2f} GB/rank {r['seconds'] * 1e3:.1f} ms"
             for a, r in rows.items()]
    cli.report({"order": list(order), "degrees": degrees, "rows": rows}, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
