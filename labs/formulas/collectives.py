"""Chapters 2, 10 and 11: what a collective costs on a link, as formulas and published constants.

NCCL's own cost model for its algorithms and protocols, as its source writes it. Nothing here is
measured: these are the constants and formulas of NCCL's tuning model, read from NVIDIA/nccl at
commit 5067397c (June 2026), `src/graph/tuning.cc` (`ncclTunerConstantsDefaults`,
`ncclTopoTuneModel`) and `src/include/device.h` (the LL and LL128 line formats); chapter 10
(`labs.collectives.nccl_model`) explains them. The link bandwidths are vendors' figures and what
NCCL's maintainers quote it reaching (chapter 11, `labs.hardware.placement`).
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


# Per direction, in bytes per second; sources in book/11-hardware.md's table.
NVLINK4_BPS = 18 * 25e9     # H100 SXM: 18 links x 25 GB/s = 450 GB/s per direction
NDR_IB_BPS = 400e9 / 8      # NDR InfiniBand: 400 Gb/s per port = 50 GB/s
PCIE5_X16_BPS = 64e9        # PCIe 5.0 x16: 32 GT/s x 16 lanes, ~64 GB/s per direction
LLAMA3_POD_GPUS = 3072      # Llama 3 section 3.3.1: a pod of 3,072 GPUs, full bisection bandwidth
# What NCCL reaches, as its maintainers quote it (book/11-hardware.md): an effective NVLink bandwidth
# of ~370 GB/s on H100 (NVIDIA/nccl-tests issue 212), 46 to 48 GB/s per NDR port (issue 290)
NCCL_NVLINK_BPS = 370e9
NCCL_NDR_BPS = (46e9, 48e9)
