"""Chapter 10: NCCL's own cost model for its algorithms and protocols, as its source writes it.

Nothing here is measured: these are the constants and formulas of NCCL's tuning model, read from
NVIDIA/nccl at commit 5067397c (June 2026), `src/graph/tuning.cc` (`ncclTunerConstantsDefaults`,
`ncclTopoTuneModel`) and `src/include/device.h` (the LL and LL128 line formats). NCCL evaluates
this model for every (algorithm, protocol) at communicator creation and, per call, picks the pair
with the least predicted time for that size, unless NCCL_ALGO or NCCL_PROTO restrict the choice.

Protocols (how a GPU signals that data has arrived):
- LL: each 16-byte store carries 8 bytes of data and two 4-byte flags (`ncclLLFifoLine`), so the
  receiver polls the data itself: the lowest latency, half the bandwidth (ring LL busBw x 0.5).
- LL128: 128-byte lines, one 8-byte flag per line (`NCCL_LL128_DATAELEMS` = 15 of 16 uint64):
  120/128 of the bandwidth (the model's 0.92), at a latency between LL's and Simple's.
- Simple: whole buffers and a memory fence per step: the full bandwidth, the highest latency.

Algorithms: Ring (all collectives); Tree (all-reduce: a chain inside each node, a double binary
tree across nodes, since NCCL 2.4.2, `src/misc/trees.cu` then); CollNetDirect and CollNetChain
(in-network reduction through a CollNet plugin such as SHARP); NVLS and NVLSTree (NVLink SHARP
in the NVSwitch; Simple only); PAT (NCCL 2.23.4: "Parallel Aggregated Trees, variation of Bruck
algorithm", all-gather and reduce-scatter, one rank per node only).

    python -m labs.collectives.nccl_model --json
"""
import math

PROTOCOLS = ("LL", "LL128", "Simple")
# tuning.cc, ncclTunerConstantsDefaults: base latency of an operation, microseconds
BASE_LATENCY_US = {"Tree": (6.8, 14.0, 8.4), "Ring": (6.6, 14.0, 8.4)}
# tuning.cc, hwLatencies: latency per step, microseconds, by link type
HW_LATENCY_US = {"NVLINK": {"Tree": (0.6, 1.25, 4.0), "Ring": (0.6, 1.9, 3.4)},
                 "NET": {"Tree": (5.0, 8.5, 14.0), "Ring": (2.7, 4.0, 14.0)}}
# tuning.cc, ncclTopoTuneModel: ring bus bandwidth factor per protocol (LL: x 0.5; LL128: x 0.92,
# "120.0/128.0" in the source's comment; Simple: the link's)
RING_BANDWIDTH_FACTOR = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
# device.h: bytes of data per line, and bytes per line, for the two low-latency protocols
LINE_FORMAT = {"LL": (8, 16), "LL128": (120, 128)}


def ring_all_reduce_latency_us(n_ranks, protocol):
    """NCCL's predicted latency of a ring all-reduce on one NVLink node: base + 2(n-1) steps."""
    p = PROTOCOLS.index(protocol)
    return BASE_LATENCY_US["Ring"][p] + 2 * (n_ranks - 1) * HW_LATENCY_US["NVLINK"]["Ring"][p]


def network_steps(n_nodes):
    """Network steps on the critical path of an all-reduce across nodes, as the model counts them:
    the ring's 2(nNodes - 1) inter-node steps against the tree's 2 log2(nNodes) (``log2i``)."""
    return {"Ring": 2 * (n_nodes - 1), "Tree": 2 * int(math.log2(n_nodes))}


def table(n_ranks=8):
    """Per protocol: data per line, the ring's bandwidth factor and its all-reduce latency on n ranks."""
    rows = []
    for proto in PROTOCOLS:
        data, line = LINE_FORMAT.get(proto, (None, None))
        rows.append({"protocol": proto, "data_bytes_per_line": data, "line_bytes": line,
                     "ring_bandwidth_factor": RING_BANDWIDTH_FACTOR[proto],
                     "ring_all_reduce_latency_us": ring_all_reduce_latency_us(n_ranks, proto)})
    return rows


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("NCCL's tuning model (src/graph/tuning.cc): per protocol, bandwidth factor and the "
                   "predicted latency of a ring all-reduce on one NVLink node.", world_size_default=8)
    args = cli.parse(p, argv)
    rows = table(args.world_size)
    lines = [f"{r['protocol']:7s} bandwidth x {r['ring_bandwidth_factor']:.2f}, ring all-reduce on "
             f"{args.world_size} GPUs: {r['ring_all_reduce_latency_us']:.1f} us (model)" for r in rows]
    cli.report({"world_size": args.world_size, "rows": rows, "network_steps_2048_nodes": network_steps(2048)},
               args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
