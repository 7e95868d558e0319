"""Chapter 11: which parallel group sits on which link tier, and the bytes each tier carries.

The degrees and the rank grid are `labs.dims.ParallelDims`, with the first axis of its ``order``
fastest-varying; Llama 3 orders its groups [TP, CP, PP, DP] (Llama Team 2024, "The Llama 3 Herd of
Models", arXiv 2407.21783, section 3.3.2). A group of N ranks along an axis whose faster axes multiply
to a stride Delta holds the ranks r0, r0 + Delta, ..., r0 + Delta(N-1). It stays inside one node of G
GPUs exactly when its first and last rank do: floor(r0 / G) = floor((r0 + Delta(N-1)) / G). Every
group of the axis does so when Delta N divides G; when Delta N <= G but does not divide it, some
groups straddle a node boundary (tp = 1, cp = 3 on nodes of 4: the group [3, 4, 5]). So the
calculator decides group by group (`ParallelDims.group_nodes`, `ParallelDims.tier`).

Bytes per rank per step, bf16 (2 bytes) unless stated, ring collectives (`labs.formulas.costs`:
2(N-1)/N * M for an all-reduce of M bytes, (N-1)/N * M for an all-gather of the full M or a
reduce-scatter; Patarasuk & Yuan 2009), for the busiest pipeline stage (chapter 5's split,
`stage_balance.stage_layers`: Llama 3 takes one layer from the first and the last stage):
- TP (Shoeybi et al. 2019, section 3): 4 all-reduces of b*(s/cp)*h per layer and micro-batch.
- CP (Llama 3 3.3.2): all-gather, reduce-scatter of K, V, 2*b*s*h_kv/tp, per layer and micro-batch.
- PP: one activation forward and one gradient back per micro-batch and model chunk, b*(s/cp)*h/tp
  bytes from each TP rank (sequence parallelism, Korthikanti et al. 2022, or Megatron's
  scatter/gather, Narayanan et al. 2021, section 4.1; without either every TP rank sends b*s*h).
  Interleaving with v chunks per rank sends v times as many (Narayanan et al. 2021, section 2.2);
  Llama 3's first chunk holds only the embedding, so a chunk is one layer: v = (126 + 2) / 16 = 8.
- DP as Llama 3 runs it (section 3.3.2): FSDP without resharding after forward: per step one
  bf16 all-gather and one fp32 reduce-scatter, 2 + 4 bytes per parameter of params/(tp*pp).
- EP (formula only, not simulated): dispatch and combine, forward and backward, 4 all-to-alls of
  k*b*s*h/(tp*cp) per MoE layer, each sending (N-1)/N of it.
The counted check, every message's destination on a simulated cluster, is `labs.hardware.boundary`.
"""
import dataclasses
from collections import Counter
from dataclasses import dataclass

from labs.dims import ORDER, ParallelDims
from labs.formulas import costs, links
from labs.memory_budget.budget import MODELS
from labs.pipeline.stage_balance import stage_layers
from labs.formulas.collectives import (  # the formulas' home is the torch-free core
    LLAMA3_POD_GPUS as LLAMA3_POD_GPUS, NCCL_NDR_BPS as NCCL_NDR_BPS, NCCL_NVLINK_BPS as NCCL_NVLINK_BPS,
    NDR_IB_BPS as NDR_IB_BPS, NVLINK4_BPS as NVLINK4_BPS, PCIE5_X16_BPS as PCIE5_X16_BPS)

BF16, FP32 = 2, 4
LLAMA3_ORDER = ("tp", "cp", "pp", "dp")   # as the paper writes it, fastest-varying first


@dataclass(frozen=True)
class Run:
    """What a step does besides the degrees: b sequences per micro-batch, m micro-batches, v chunks per
    rank, a gathered weight's and a reduced gradient's bytes, and whether a TP rank's PP send is 1/tp of
    the activation (sequence parallelism, or Megatron's scatter/gather) or the whole b s h (neither)."""
    micro_batch: int = 1
    micro_batches: int = 1
    v: int = 1
    param_bytes: int = BF16
    grad_bytes: int = BF16
    pp_send_split: bool = True


LLAMA3_405B = MODELS["405B"]   # chapter 1's shapes (Table 3), s = 8,192 (Table 4)
# 16 micro-batches of one sequence: an assumption. Table 4 prints 16 sequences per DP rank ("batch
# size/DP") at DP = 128, not the micro-batch size; the book takes one sequence per micro-batch. v = 8 (above);
# bf16 weights gathered, fp32 gradients reduce-scattered (section 3.3.2)
LLAMA3_RUN = Run(micro_batch=1, micro_batches=16, v=8, param_bytes=BF16, grad_bytes=FP32)
LLAMA3_DIMS = ParallelDims(tp=8, pp=16, dp=128)


@dataclass(frozen=True)
class Placement:
    """A layout (`ParallelDims`: degrees, order, groups) on nodes of ``gpus_per_node`` GPUs. Each
    group's bandwidth per GPU is `bandwidth`: a ring's comes from `labs.formulas.links.ring_bandwidth`."""
    dims: ParallelDims
    gpus_per_node: int = 8

    def __post_init__(self):
        g = self.gpus_per_node
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"gpus_per_node must be a positive integer, got {g!r}.")

    def tier(self, axis):
        return self.dims.tier(axis, self.gpus_per_node)

    def group_nodes(self, axis, unit=None):
        return self.dims.group_nodes(axis, unit or self.gpus_per_node)

    def bandwidth(self, axis, kind="ring"):
        """Bytes/s per direction per GPU for ``axis``'s traffic, its slowest group's. A ring inside a
        node runs on NVLink; a ring across nodes leaves each node through the NICs of the group's GPUs
        there (NCCL spreads its channels over them): `links.ring_bandwidth`, with the fewest of the
        group's GPUs on any one of its nodes. So a DP group of 16 whole 8-GPU nodes moves 8 x 50 GB/s per
        node (400 GB/s per GPU, effective), and a group with one GPU per node one NIC's 50 GB/s. A
        point-to-point ``send`` that leaves the node uses its GPU's own NIC."""
        g, worst = self.gpus_per_node, None
        for group in self.dims.groups(axis):
            counts = Counter(r // g for r in group)
            bw = (links.ring_bandwidth(1, 1, g) if len(counts) == 1 else NDR_IB_BPS if kind == "send"
                  else links.ring_bandwidth(len(counts), min(counts.values()), g))
            worst = bw if worst is None else min(worst, bw)
        return worst


def collectives(model, p, run=LLAMA3_RUN):
    """Per axis, the calls of one rank per step: [(kind, payload bytes M per call, calls)], from the
    shapes, for the pipeline stage with the most layers (DP: the average stage's parameters)."""
    d, b, m, v = p.dims, run.micro_batch, run.micro_batches, run.v
    local_layers = max(len(layers) for layers in stage_layers(model.layers, d.pp, v))
    act = b * (model.seq // d.cp) * model.hidden * BF16                          # (b, s/cp, h)
    kv = 2 * b * model.seq * model.kv_heads * model.head_dim // d.tp * BF16      # K and V, full s
    params = model.params() // (d.tp * d.pp)
    out = {"tp": [("all_reduce", act, 4 * local_layers * m)],
           "cp": [("all_gather", kv, 2 * local_layers * m)],
           "pp": [("send", act // d.tp if run.pp_send_split else act, 2 * v * m)],   # every chunk, both ways
           "dp": [("all_gather", params * run.param_bytes, 1),
                  ("reduce_scatter", params * run.grad_bytes, 1)]}
    moe_layers = sum(model.is_moe_layer(i) for i in range(model.layers))
    if moe_layers:
        tokens = model.top_k * b * model.seq * model.hidden * BF16 // (d.tp * d.cp)
        out["ep"] = [("all_to_all", tokens, 4 * moe_layers // d.pp * m)]
    return out


def plan(model, p, run=LLAMA3_RUN):
    """Bytes per rank per step on each axis, its tier, and the time at that tier's bandwidth; per
    axis its calls too ("calls": [(kind, payload, calls, bytes sent)])."""
    rows = {}
    for axis, calls in collectives(model, p, run).items():
        n, tier = p.dims.size(axis), p.tier(axis)
        parts = [(kind, m, k, costs.sent(kind, m, n) * k) for kind, m, k in calls]
        sent = sum(part[3] for part in parts)
        bw = p.bandwidth(axis, "send" if parts[0][0] == "send" else "ring")
        rows[axis] = {"degree": n, "kind": " + ".join(part[0] for part in parts),
                      "payload_bytes": parts[0][1], "calls": parts, "tier": tier, "bytes_per_rank": sent,
                      "bytes_per_s": bw, "seconds": sent / bw}
    return rows


def pod_edges(dims, axis, pod=LLAMA3_POD_GPUS):
    """Ring edges of ``axis`` (i -> i+1 mod N in each group, one direction) that leave the busiest pod:
    the flows that share its uplinks at once. PP's interleaved chain of chunks (chunk c on rank c mod
    p) has the same edges, the wrap-around included. Ranks are taken to fill pods in order from rank 0,
    ``pod`` to a pod: an assumption (Llama 3's scheduler places ranks to cut cross-pod traffic, 3.3.1)."""
    out = {}
    for group in dims.groups(axis):
        for i, r in enumerate(group if len(group) > 1 else []):
            if r // pod != group[(i + 1) % len(group)] // pod:
                out[r // pod] = out.get(r // pod, 0) + 1
    return max(out.values(), default=0)


LLAMA3_FLOPS_PER_GPU = 400e12      # Table 4: BF16 TFLOPs per GPU, whole-step average


def exposed(model, p, run=LLAMA3_RUN, flops_per_gpu=LLAMA3_FLOPS_PER_GPU, oversubscription=7):
    """PP against DP, the two groups that leave the node, as time on the critical path.

    PP: the first micro-batch's activation crosses every boundary between the p v model chunks (on p
    ranks, chunk c on rank c mod p, so consecutive chunks live on different ranks) before the last
    chunk can start, and the last gradient crosses them back, with every rank waiting: at least
    2(p v - 1) sends of one activation lie on the critical path, whatever else overlaps.

    DP as Llama 3 runs it (section 3.3.2: FSDP that "can tolerate longer network latency by
    asynchronously prefetching sharded model weights and reducing gradients"; gradients accumulated
    over the micro-batches in fp32): per chunk, 1/v of the average stage's parameters, one bf16
    all-gather before the chunk's first forward and one fp32 reduce-scatter after its last backward.
    On rank 0 the first chunk's gather has nothing to overlap and its last reduce-scatter no compute
    after it (other ranks: `exposed_pair`); (gather + reduce) / v bounds that. The others hide if each
    chunk's piece fits in its window: a rank's consecutive local chunks are p model chunks apart, so
    between the last backwards of two of them the last micro-batch's gradient runs through p chunk
    backwards and p sends, p (B / (m v) + send) at least (forward: p (F / (m v) + send)), with
    F = 2 P T / (GPUs FLOP/s) and B = 2 F (chapter 1's 6 P T, attention's FLOPs left out), at
    Table 4's 400 TFLOP/s per GPU. Latencies: every waited-for PP send pays one; a ring all-gather or
    reduce-scatter over N ranks takes N - 1 steps, each paying one, so DP's exposed pair pays 2(N - 1).
    Pods: how many of Llama 3's pods of 3,072 GPUs (section 3.3.1) one group of each axis spans, how
    many of PP's critical sends cross a pod boundary, and per axis the ring edges leaving the busiest
    pod (`pod_edges`) against its uplinks, 1:7 oversubscribed: 3,072 / 7 ports' worth.

    The times above give PP and DP each a whole port. In Llama 3's order both leave through the GPU's
    own NIC, and a chunk's reduce-scatter starts as the same micro-batch's gradient is sent on: if
    each of the backward chain's p v - 1 sends got half the port while the two overlap, the chain
    would grow by up to (p v - 1) sends' time (``pp_shared_nic_extra_s``, a bound, not a schedule)."""
    rows, d = plan(model, p, run), p.dims
    send = rows["pp"]["payload_bytes"]
    send_s = send / rows["pp"]["bytes_per_s"] if d.pp > 1 else 0.0
    tokens = run.micro_batch * model.seq * run.micro_batches * d.dp   # a CP group shares a sequence
    forward_s = 2 * model.params() * tokens / (d.world_size * flops_per_gpu)
    dp_bw = rows["dp"]["bytes_per_s"]
    (_, _, _, gather), (_, _, _, reduce) = rows["dp"]["calls"]
    critical = 2 * (d.pp * run.v - 1) if d.pp > 1 else 0
    pod = [r // LLAMA3_POD_GPUS for r in d.groups("pp")[0]]          # every PP group alike here
    crossing = 2 * sum(pod[c % d.pp] != pod[(c + 1) % d.pp] for c in range(d.pp * run.v - 1))
    chunk_gather_s, chunk_reduce_s = gather / dp_bw / run.v, reduce / dp_bw / run.v
    slots = run.micro_batches * run.v
    chunk_forward_s, chunk_backward_s = forward_s / slots, 2 * forward_s / slots
    window_forward_s = d.pp * (chunk_forward_s + send_s)     # p chunk passes and p sends apart
    window_backward_s = d.pp * (chunk_backward_s + send_s)
    # rank r's chunk r, r sends and chunks 0..r-1 from the ends; chunk 0 the embedding alone: no compute
    avg = model.params() / (d.tp * d.pp * run.v)
    emb = len(stage_layers(model.layers, d.pp, run.v)[0]) < run.v
    n = lambda r: max(0, r - emb)                       # layer chunks before chunk r (Llama 3's split)
    ranks = [((model.vocab * model.hidden / d.tp / avg if emb and r == 0 else 1.0),
              n(r) * chunk_forward_s + r * send_s, n(r) * chunk_backward_s + r * send_s) for r in range(d.pp)]
    return {"pp_send_bytes": send, "pp_sends_per_step": rows["pp"]["calls"][0][2], "pp_send_s": send_s,
            "pp_critical_sends": critical, "pp_critical_s": critical * send_s,
            "pp_critical_crossing_pods": crossing,
            "pp_shared_nic_extra_s": critical // 2 * send_s if rows["dp"]["tier"] == "inter" else 0.0,
            "dp_bytes": rows["dp"]["bytes_per_rank"], "dp_s": rows["dp"]["seconds"],
            "dp_gather_bytes": gather, "dp_reduce_bytes": reduce, "dp_gather_s": gather / dp_bw,
            "dp_reduce_s": reduce / dp_bw, "forward_s": forward_s, "backward_s": 2 * forward_s,
            "chunk_gather_s": chunk_gather_s, "chunk_reduce_s": chunk_reduce_s,
            "chunk_forward_s": chunk_forward_s, "chunk_backward_s": chunk_backward_s,
            "window_forward_s": window_forward_s, "window_backward_s": window_backward_s,
            "chunk_reduce_share": chunk_reduce_s / window_backward_s,
            "chunk_gather_share": chunk_gather_s / window_forward_s,
            "dp_exposed_s": chunk_gather_s + chunk_reduce_s, "dp_ranks": ranks,
            "pp_critical_latencies": critical, "dp_exposed_latencies": 2 * (d.dp - 1),
            "dp_gather_share_of_forward": gather / dp_bw / forward_s,
            "dp_reduce_share_of_backward": reduce / dp_bw / (2 * forward_s),
            "pods_per_group": {a: max(p.group_nodes(a, LLAMA3_POD_GPUS)) for a in LLAMA3_ORDER},
            "pod_edges": {a: pod_edges(d, a) for a in LLAMA3_ORDER},
            "pod_uplink_ports": LLAMA3_POD_GPUS / oversubscription}


def exposed_pair(e, rate=1.0):
    """DP's exposed pair at ``rate`` of the port, the largest gather plus the largest reduce-scatter overrun
    over `exposed`'s ``dp_ranks``: they add on any ranks (one delays the chain's start, one its end)."""
    over = lambda k, x, w: max(0.0, k * e[x] / rate - w)
    return (max(over(k, "chunk_gather_s", f) for k, f, _ in e["dp_ranks"])
            + max(over(k, "chunk_reduce_s", b) for k, _, b in e["dp_ranks"]))


def outer_position(dp_out, pp_out, oversubscription=7):
    """What the outer position changes, from `exposed` in both orders (``dp_out``: DP outermost,
    Llama 3's; ``pp_out``: PP and DP swapped). PP's chain and DP's exposed pair leave the node in
    either order; only the parts that cross pods depend on it: PP outermost, the chain's sends that
    cross a pod (``pp_critical_crossing_pods`` of them); DP outermost, its exposed pair. Each is priced
    at a rate r of the port: 1 (the full port), 1/oversubscription (every crossing flow slowed alike)
    and min(1, uplink ports / flows leaving a pod) (the uplinks shared evenly by the groups' ring
    edges); the inner group keeps the full port. Per rate, the seconds per step of those two parts in
    each order, the pair as `exposed_pair` (``*_upper_s``: as ``dp_exposed_s``, its upper bound while
    chunk 0 is no larger than the average), and its window's share a chunk's reduce-scatter fills."""
    cross = pp_out["pp_critical_crossing_pods"] * pp_out["pp_send_s"]
    share = lambda e, axis: min(1.0, e["pod_uplink_ports"] / e["pod_edges"][axis])
    rates = {"full": (1.0, 1.0), "slowed": (1 / oversubscription,) * 2,
             "shared": (share(dp_out, "dp"), share(pp_out, "pp"))}
    return {name: {"dp_outermost_s": exposed_pair(dp_out, r_dp) + cross,
                   "pp_outermost_s": exposed_pair(pp_out) + cross / r_pp,
                   "dp_outermost_upper_s": dp_out["dp_exposed_s"] / r_dp + cross,
                   "pp_outermost_upper_s": pp_out["dp_exposed_s"] + cross / r_pp,
                   "pp_cross_s": cross / r_pp, "dp_exposed_s": exposed_pair(dp_out, r_dp),
                   "rate_dp": r_dp, "rate_pp": r_pp,
                   "chunk_reduce_share": dp_out["chunk_reduce_share"] / r_dp}
            for name, (r_dp, r_pp) in rates.items()}


def _tp_traffic(order):
    return plan(LLAMA3_405B, Placement(ParallelDims(tp=8, pp=16, dp=128, order=order)))["tp"]


ANSWERS = {  # chapter 11's exercises, computed by the calculator above
    "11.1": lambda: _tp_traffic(ORDER)["bytes_per_rank"] / 1e9,          # GB per rank per step
    "11.2": lambda: _tp_traffic(tuple(reversed(ORDER)))["seconds"],      # s, TP over NDR
    "11.3": lambda: sum(n > 1 for n in ParallelDims(cp=3, dp=8).group_nodes("cp", 8)),  # CP groups off a node
    "11.4": lambda: exposed(LLAMA3_405B, Placement(LLAMA3_DIMS))["pp_critical_sends"],
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "11.1": [(lambda: ANSWERS["11.1"]()
              * (LLAMA3_405B.layers // 16) / max(map(len, stage_layers(LLAMA3_405B.layers, 16))),
              f"{LLAMA3_405B.layers} // 16 layers on every stage"),
             (lambda: ANSWERS["11.1"]()
              * (LLAMA3_405B.layers / 16) / max(map(len, stage_layers(LLAMA3_405B.layers, 16))),
              f"{LLAMA3_405B.layers} / 16 layers on every stage: "
              "the first and last stages' lighter load ignored"),
             (lambda: ANSWERS["11.1"]() * 8 / 7, "2M per all-reduce: the ring's (N-1)/N left out")],
    "11.2": [(lambda: ANSWERS["11.2"]() * NDR_IB_BPS / NVLINK4_BPS, "the NVLink time, not the network's"),
             # 50/48 is within 1 % of MiB/MB's 1.049: named here so the slip does not claim it
             *[(lambda bps=bps: ANSWERS["11.2"]() * NDR_IB_BPS / bps,
                "NCCL's effective bandwidth used instead of the line rate") for bps in NCCL_NDR_BPS],
             (lambda: ANSWERS["11.2"]() / 8, "400 Gb/s read as 400 GB/s")],
    "11.3": [(lambda: 0, "Delta N <= G_node taken as enough: every CP group has fewer ranks than a node"),
             (lambda: 8 - ANSWERS["11.3"](), "the groups that stay inside one node, not those that cross")],
    "11.4": [(lambda: 2 * (LLAMA3_DIMS.pp - 1), "v = 1: the 8 chunks per rank left out"),
             (lambda: LLAMA3_DIMS.pp * LLAMA3_RUN.v - 1, "the forward crossings only"),
             (lambda: 2 * LLAMA3_RUN.v * LLAMA3_RUN.micro_batches,
              "2 v m, all of a rank's sends, or 2 p v, p v boundaries: the chain has p v - 1 each way")],
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
    p.add_argument("--v", type=cli.positive_int, default=LLAMA3_RUN.v,
                   help="model chunks per rank (Llama 3: 8)")
    p.add_argument("--gpus-per-node", type=cli.positive_int, default=8)
    p.add_argument("--reversed", action="store_true", help="order [DP, PP, CP, TP] instead of Llama 3's")
    args = cli.parse(p, argv)
    degrees = {a: getattr(args, a) for a in ("tp", "cp", "pp", "dp")}
    order = tuple(reversed(ORDER)) if args.reversed else ORDER
    dims = ParallelDims(**degrees, order=order)
    if args.world_size not in (None, dims.world_size):
        raise ValueError(f"--world-size {args.world_size} is not tp*cp*pp*dp = {dims.world_size}; "
                         "drop --world-size or change the degrees.")
    run = dataclasses.replace(LLAMA3_RUN, v=args.v)
    stage_layers(LLAMA3_405B.layers, args.pp, args.v)   # refuse more chunks than the model can fill
    rows = plan(LLAMA3_405B, Placement(dims, gpus_per_node=args.gpus_per_node), run)
    lines = [f"{a}: {r['tier']} {r['bytes_per_rank'] / 1e9:.2f} GB/rank {r['seconds'] * 1e3:.1f} ms"
             for a, r in rows.items()]
    cli.report({"order": list(order), "degrees": degrees, "v": args.v, "rows": rows}, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
