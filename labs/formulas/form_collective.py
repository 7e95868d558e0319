"""Chapters 2 and 10's calculator: how long one collective takes, alpha plus bytes over the link.

`links.collective_time` (chapter 14's model of a collective): NCCL's latency for the call, from its own
tuning constants, plus the formula bytes one rank sends (`costs`, the ring factors) over the slowest
link the group crosses, at the bandwidth NCCL reaches on it. An estimate from formulas and published
constants, not a measurement; chapter 10 fits alpha and beta on the machine it runs on.
"""
from labs.formulas import costs, fields, links
from labs.formulas.fields import Field
from labs.formulas.planning import shapes

MIB = 2 ** 20
CLUSTERS = {"H100 80GB (DGX H100)": shapes.DGX_H100, "A100 80GB (DGX A100)": shapes.SELENE,
            "2 x RTX 3090 (PCIe)": shapes.workstation_3090()}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
FIELDS = (Field("op", "collective", "choice", "all_reduce", OPS),
          Field("size_mib", "buffer M (MiB)", "float", "64",
                help="the all-reduce's input, the all-gather's output"),
          Field("ranks", "GPUs n", "int", "8", help="filling nodes in order"),
          Field("cluster", "GPU and links", "choice", tuple(CLUSTERS)[0], tuple(CLUSTERS)))


def answer(values):
    op, name = fields.choice(values, FIELDS[0]), fields.choice(values, FIELDS[3])
    size, n, cluster = fields.number(values, FIELDS[1]) * MIB, fields.whole(values, FIELDS[2]), \
        CLUSTERS[name]
    if n < 2:
        raise ValueError(f"a collective needs at least 2 GPUs, got {n}.")
    nodes = -(-n // cluster.gpus_per_node)
    seconds = links.collective_time(op, size, n, nodes, cluster)
    alpha = links.alpha(op, n, nodes, cluster.link)
    factor = float(costs.factor(op, n))
    bw = cluster.intra_bw if nodes == 1 else cluster.inter_bw
    where = "inside one node" if nodes == 1 else f"across {nodes:,} nodes"
    crossover = alpha * size / (seconds - alpha) / MIB     # the buffer whose bytes take as long as alpha
    return {"ok": True,
            "summary": f"{op} of {size / MIB:,.1f} MiB over {n:,} GPUs {where} ({name}): "
                       f"{seconds * 1e3:,.3f} ms by NCCL's cost model, {alpha * 1e6:,.1f} us of latency and "
                       f"{(seconds - alpha) * 1e3:,.3f} ms of bytes: each GPU sends {factor:.3f} M. Below a "
                       f"buffer of about {crossover:,.2f} MiB the latency is the larger part.",
            "table": {"head": ["term", "value"],
                      "rows": [["time (ms)", f"{seconds * 1e3:,.3f}"],
                               ["latency alpha (us)", f"{alpha * 1e6:,.1f}"],
                               ["bytes each GPU sends (MiB)", f"{factor * size / MIB:,.1f}"],
                               ["link bandwidth (GB/s)", f"{bw / 1e9:,.0f}"],
                               ["algorithm bandwidth M / time (GB/s)", f"{size / seconds / 1e9:,.1f}"],
                               ["bus bandwidth, nccl-tests' (GB/s)",
                                f"{factor * size / seconds / 1e9:,.1f}"]]}}
