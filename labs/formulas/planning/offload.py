"""Chapter 14: the optimizer in host memory (ZeRO-Offload, Ren et al. 2021, arXiv 2101.06840): what it
frees on the GPU, what it needs on the host, and what it costs per step.

With the optimizer offloaded, each GPU keeps its 16-bit weights (sharded under ZeRO-3) and sends its
16-bit gradient partition to the host after backward; the CPU runs Adam on the fp32 master weights
and moments, and the updated 16-bit weights come back (Ren et al. 2021, §4.1: "fp16 gradients" down,
"fp16 parameters" up, the Adam update on the CPU). Per parameter of the rank's partition:

    host memory   fp32 master, m, v and an fp32 copy of the gradient: 16 bytes (`HOST_BYTES`)
    PCIe          2 bytes down (gradient) + 2 bytes up (weights), one each way per step
    host memory   Adam's traffic, `ADAM_BYTES` = 30 bytes per parameter, on the CPU's memory,
                  which the node's GPUs share

Each byte crosses the host link twice over a step, as chapter 9's offload lab counts for
activations (`labs.recompute.offload`: every saved byte copied to the host and back). The link is the
GPU's PCIe (`Cluster.host_bw`), the CPU's memory bandwidth `Cluster.host_mem_bw`. The copies and the
CPU's Adam are charged in full: the planner does not assume ZeRO-Offload's one-step delayed update,
which overlaps them with the next step (§4.2), because it changes the training, not just its speed.
"""
HOST_BYTES = 16       # fp32 master, m, v and gradient per offloaded parameter
PCIE_BYTES = 2        # a 16-bit gradient down, a 16-bit weight up: 2 bytes each way
ADAM_BYTES = 30       # Adam's reads and writes per parameter (the optimizer step's in `timing` too)


def host_bytes(params_per_rank, ranks_per_node):
    """Host memory a node needs for its ranks' offloaded optimizer state."""
    return HOST_BYTES * params_per_rank * ranks_per_node


def optimizer_seconds(cluster, params_per_rank):
    """Seconds of one offloaded optimizer step for a rank with ``params_per_rank`` parameters in its
    partition: the PCIe copies (each way at once, the slower of the two) and the CPU's Adam, whose
    memory bandwidth the node's ranks share."""
    if not cluster.host_mem_bw:
        raise ValueError(f"{cluster.name} states no host memory bandwidth; offloading needs one "
                         "(Cluster.host_mem_bw).")
    pcie = PCIE_BYTES * params_per_rank / cluster.host_bw
    adam = ADAM_BYTES * params_per_rank * cluster.gpus_per_node / cluster.host_mem_bw
    return pcie + adam


def fits_host(cluster, params_per_rank):
    """Whether the node's host memory holds its ranks' optimizer state, and the bytes it needs."""
    need = host_bytes(params_per_rank, cluster.gpus_per_node)
    return {"needed_bytes": need, "host_bytes": cluster.host_bytes,
            "fits": bool(cluster.host_bytes) and need <= cluster.host_bytes}
