"""Chapter 11: which parallel group sits on which link tier, and the bytes each tier carries.

Ranks are laid out with the first axis of ``order`` fastest-varying; Llama 3 orders its groups
[TP, CP, PP, DP] (Llama Team 2024, "The Llama 3 Herd of Models", arXiv 2407.21783, section 3.3.2).
A group of N ranks along an axis whose faster axes multiply to a stride Delta holds the ranks
r0, r0 + Delta, ..., r0 + Delta(N-1). It stays inside one node of G GPUs exactly when its first
and last rank do: floor(r0 / G) = floor((r0 + Delta(N-1)) / G). Every group of the axis does so
when Delta N divides G; when Delta N <= G but does not divide it, some groups straddle a node
boundary (tp = 1, cp = 3 on nodes of 4: the group [3, 4, 5]). So the calculator decides group by
group (`group_nodes`).

Bytes per rank per step, bf16 (2 bytes), ring collectives (2(N-1)/N * M for an all-reduce of M
bytes, (N-1)/N * M for an all-gather of the full M; Patarasuk & Yuan 2009), for the busiest
pipeline stage (`stage_layers`: Llama 3 takes one layer from the first and the last stage):
- TP (Megatron, Shoeybi et al. 2019, section 3): 4 all-reduces of b*(s/cp)*h per layer per
  micro-batch (2 forward, 2 backward).
- CP (all-gather of K and V, Llama 3 section 3.3.2): forward all-gather and backward
  reduce-scatter of 2*b*s*h_kv/tp per layer per micro-batch.
- PP: one activation forward and one gradient back per micro-batch and boundary, b*(s/cp)*h/tp
  bytes from each TP rank: each TP rank sends only its 1/tp of the activation, which holds with
  sequence parallelism (Korthikanti et al. 2022: between blocks each TP rank keeps s/tp of the
  sequence) or with Megatron's scatter/gather (Narayanan et al. 2021, section 4.1: the sender
  splits the tensor into tp chunks, the receiver all-gathers them over NVLink). Without either,
  every TP rank would send the whole b*s*h. An interleaved schedule with v chunks per rank sends
  v times as many (Narayanan et al. 2021, section 2.2).
- DP: one all-reduce of the gradients, params/(tp*pp) per rank, per step.
- EP (formula only, not simulated): dispatch and combine, forward and backward, 4 all-to-alls of
  k*b*s*h/(tp*cp) per MoE layer, each sending (N-1)/N of it.
The counted check, every message's destination on a simulated cluster, is `labs.hardware.boundary`.
"""
from dataclasses import dataclass, field

import torch

BF16 = 2
ORDER = ("tp", "cp", "pp", "dp")  # Llama 3's order, fastest-varying first
# Per direction, in bytes per second; sources in book/11-hardware.md's table.
NVLINK4_BPS = 18 * 25e9     # H100 SXM: 18 links x 25 GB/s = 450 GB/s per direction
NDR_IB_BPS = 400e9 / 8      # NDR InfiniBand: 400 Gb/s per port = 50 GB/s
PCIE5_X16_BPS = 64e9        # PCIe 5.0 x16: 32 GT/s x 16 lanes, ~64 GB/s per direction
LLAMA3_POD_GPUS = 3072      # Llama 3 section 3.3.1: a pod of 3,072 GPUs, full bisection bandwidth
# What NCCL reaches, as its maintainers quote it (book/11-hardware.md): an effective NVLink bandwidth
# of ~370 GB/s on H100 (NVIDIA/nccl-tests issue 212), 46 to 48 GB/s per NDR port (issue 290)
NCCL_NVLINK_BPS = 370e9
NCCL_NDR_BPS = (46e9, 48e9)


@dataclass(frozen=True)
class Model:
    """Shapes that set the traffic: hidden h, KV width h_kv, layers L, sequence s, micro-batch b."""
    hidden: int
    kv_hidden: int
    layers: int
    params: int
    seq: int
    micro_batch: int = 1
    micro_batches: int = 1
    moe_layers: int = 0
    top_k: int = 1


# Llama 3 Table 3 shapes; 16 micro-batches of one sequence: Table 4's 16 sequences per DP rank at DP = 128
LLAMA3_405B = Model(hidden=16384, kv_hidden=8 * 128, layers=126, params=405_000_000_000, seq=8192,
                    micro_batches=16)


def stage_layers(layers, pp):
    """Transformer layers per pipeline stage with Llama 3's balance (section 3.3.2: "we reduce one
    Transformer layer each from the first and the last stages"): the embedding and the output head
    each take a layer's slot, L + 2 slots split as evenly as possible. 126 on 16: [7, 8, ..., 8, 7]."""
    if pp < 1 or layers + 2 < 2 * pp:
        raise ValueError(f"{layers} layers cannot fill {pp} pipeline stages; use at most {(layers + 2) // 2} stages.")
    if pp == 1:
        return [layers]
    base, extra = divmod(layers + 2, pp)
    slots = [base + (1 if i < extra else 0) for i in range(pp)]
    slots[0], slots[-1] = slots[0] - 1, slots[-1] - 1
    return slots


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
        g = self.gpus_per_node
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"gpus_per_node must be a positive integer, got {g!r}.")

    @property
    def world_size(self):
        out = 1
        for axis in ORDER:
            out *= self.degrees.get(axis, 1)
        return out

    def stride(self, axis):
        """Distance Delta in global rank between neighbours of ``axis``: the product of faster axes."""
        out = 1
        for a in self.order[:self.order.index(axis)]:
            out *= self.degrees.get(a, 1)
        return out

    def grid(self):
        """Rank grid with dims in ``order`` reversed (slowest first), so order[0] is contiguous."""
        shape = [self.degrees.get(a, 1) for a in reversed(self.order)]
        return torch.arange(self.world_size).view(shape)

    def groups(self, axis):
        dim = list(reversed(self.order)).index(axis)
        moved = self.grid().movedim(dim, -1)
        return moved.reshape(-1, moved.shape[-1]).tolist()

    def group_nodes(self, axis, unit=None):
        """Per group of ``axis``, how many units of ``unit`` GPUs (default: nodes) its ranks touch."""
        unit = unit or self.gpus_per_node
        return [len({r // unit for r in ranks}) for ranks in self.groups(axis)]

    def tier(self, axis):
        """"intra" when every group of ``axis`` is inside one node; a synchronous step waits for its
        slowest group, so one straddling group puts the axis on the slow tier."""
        return "intra" if max(self.group_nodes(axis)) == 1 else "inter"


def tier_of(stride, n, gpus_per_node):
    """The tier of a group of n ranks whose faster axes multiply to ``stride``: "intra" exactly
    when stride * n <= gpus_per_node (the rule `Placement.nodes_spanned` applies per axis)."""
    return "intra" if n == 1 or stride * n <= gpus_per_node else "inter"


def collectives(model, p):
    """Per axis: (kind, payload bytes M per call, calls per rank per step), from the shapes, for the
    pipeline stage with the most layers."""
    d = {a: p.degrees.get(a, 1) for a in ORDER}
    local_layers = max(stage_layers(model.layers, d["pp"]))
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


def exposed(model, p, flops_per_gpu=400e12):
    """PP against DP, the two groups that leave the node, as time on the critical path.

    PP: the first micro-batch's activation crosses all p - 1 stage boundaries before the last stage
    can start, and the last gradient crosses them back, with every stage waiting: at least 2(p - 1)
    sends of one activation lie on the critical path, whatever else overlaps. DP: one reduction
    per step that FSDP runs behind the backward pass (Llama 3 section 3.3.2: DP "can tolerate longer
    network latency by asynchronously prefetching sharded model weights and reducing gradients");
    the backward pass's length is 4 * params * tokens / (GPUs * FLOP/s), two thirds of 6 P T
    (chapter 1), at Table 4's 400 TFLOP/s per GPU on 16,384 GPUs. Also how many of Llama 3's pods
    of 3,072 GPUs (section 3.3.1; 1:7 oversubscribed above them) one group of each axis spans."""
    rows, pp = plan(model, p), p.degrees.get("pp", 1)
    send_s = rows["pp"]["payload_bytes"] / p.tiers[rows["pp"]["tier"]]
    tokens = model.micro_batch * model.seq * model.micro_batches * p.degrees.get("dp", 1)  # a CP group shares a sequence
    backward_s = 4 * model.params * tokens / (p.world_size * flops_per_gpu)
    return {"pp_send_bytes": rows["pp"]["payload_bytes"], "pp_sends_per_step": rows["pp"]["calls"],
            "pp_send_s": send_s, "pp_critical_sends": 2 * (pp - 1), "pp_critical_s": 2 * (pp - 1) * send_s,
            "dp_bytes": rows["dp"]["bytes_per_rank"], "dp_s": rows["dp"]["seconds"], "backward_s": backward_s,
            "dp_share_of_backward": rows["dp"]["seconds"] / backward_s,
            "pods_per_group": {a: max(p.group_nodes(a, LLAMA3_POD_GPUS)) for a in ORDER}}


def _tp_traffic(order):
    layout = Placement({"tp": 8, "cp": 1, "pp": 16, "dp": 128}, order=order)
    return plan(LLAMA3_405B, layout)["tp"]


ANSWERS = {  # chapter 11's exercises, computed by the calculator above
    "11.1": lambda: _tp_traffic(ORDER)["bytes_per_rank"] / 1e9,          # GB per rank per step
    "11.2": lambda: _tp_traffic(tuple(reversed(ORDER)))["seconds"],      # s, TP over NDR
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "11.1": [(lambda: ANSWERS["11.1"]() * (LLAMA3_405B.layers // 16) / max(stage_layers(LLAMA3_405B.layers, 16)),
              f"{LLAMA3_405B.layers} // 16 layers on every stage"),
             (lambda: ANSWERS["11.1"]() * (LLAMA3_405B.layers / 16) / max(stage_layers(LLAMA3_405B.layers, 16)),
              f"{LLAMA3_405B.layers} / 16 layers on every stage: "
              "the first and last stages' lighter load ignored"),
             (lambda: ANSWERS["11.1"]() * 8 / 7, "2M per all-reduce: the ring's (N-1)/N left out")],
    "11.2": [(lambda: ANSWERS["11.2"]() * NDR_IB_BPS / NVLINK4_BPS, "the NVLink time, not the network's"),
             (lambda: ANSWERS["11.2"]() / 8, "400 Gb/s read as 400 GB/s")],
}


def check(question, answer, rel=0.01):
    from labs.measure import exercises
    return exercises.check(ANSWERS, question, answer, rel, MISTAKES)


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
    stage_layers(LLAMA3_405B.layers, args.pp)   # refuse more stages than the model can fill
    rows = plan(LLAMA3_405B, layout)
    lines = [f"{a}: {r['tier']} {r['bytes_per_rank'] / 1e9:.2f} GB/rank {r['seconds'] * 1e3:.1f} ms"
             for a, r in rows.items()]
    cli.report({"order": list(order), "degrees": degrees, "rows": rows}, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
