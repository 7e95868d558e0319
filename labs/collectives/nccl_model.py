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
from labs.formulas.collectives import (  # the formulas' home is the torch-free core
    BASE_LATENCY_US as BASE_LATENCY_US, HW_LATENCY_US as HW_LATENCY_US, LINE_FORMAT as LINE_FORMAT,
    PROTOCOLS as PROTOCOLS, RING_BANDWIDTH_FACTOR as RING_BANDWIDTH_FACTOR, network_steps as
    network_steps, ring_all_reduce_latency_us as ring_all_reduce_latency_us, table as table)


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
