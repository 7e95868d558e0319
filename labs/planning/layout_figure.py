"""Chapter 14: the picture of a layout on the GPUs, one grid cell per GPU, one row per node.

Each cell is coloured by the data-parallel replica the GPU belongs to (a replica holds one whole copy
of the model); its label gives the GPU's place inside the replica (tensor-parallel shard ``t``,
pipeline stage ``s``, context-parallel chunk ``c``, from `labs.dims.ParallelDims.coords`), and a
thick box surrounds each tensor-parallel group, or each context-parallel group where tp = 1: the
groups whose collectives run inside every layer. GPUs that share a label and differ in colour form
a data-parallel group. Drawn from the degrees alone: no run, nothing timed.
"""
REPLICA_COLOURS = ("#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb", "#fcbba1", "#d9d9d9", "#f6e8c3",
                   "#c7eae5")


def cells(dims, gpus_per_node):
    """[(row, column, replica, label)] for every rank of ``dims``: row = node, column = GPU on it."""
    out = []
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        label = " ".join(f"{short}{c[axis]}" for axis, short in (("tp", "t"), ("pp", "s"), ("cp", "c"))
                         if dims.size(axis) > 1)
        out.append((rank // gpus_per_node, rank % gpus_per_node, c["dp"], label))
    return out


def boxed_groups(dims):
    """The rank lists a box surrounds: the tensor-parallel groups, or the context-parallel ones
    where tp = 1 (none when both are 1)."""
    axis = "tp" if dims.tp > 1 else "cp" if dims.cp > 1 else None
    return dims.groups(axis) if axis else []


def runs(groups, gpus_per_node):
    """[(first rank, length)]: each group cut into runs of consecutive ranks on one node."""
    out = []
    for group in groups:
        start = len(out)
        for rank in group:
            last = out[-1] if len(out) > start else None
            if last and rank == sum(last) and rank % gpus_per_node:
                out[-1] = (last[0], last[1] + 1)
            else:
                out.append((rank, 1))
    return out


def draw(layouts, gpus_per_node=8, width=4.6):
    """``layouts``: [(title, ParallelDims)], drawn as grids stacked one above the other."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows = [d.world_size // gpus_per_node for _, d in layouts]
    fig, axes = plt.subplots(len(layouts), 1, figsize=(width, 0.42 * sum(rows) + 0.55 * len(layouts)),
                             height_ratios=rows, squeeze=False)
    for ax, (title, dims) in zip(axes[:, 0], layouts):
        for r, col, replica, label in cells(dims, gpus_per_node):
            ax.add_patch(Rectangle((col, r), 1, 1, facecolor=REPLICA_COLOURS[replica % 8],
                                   edgecolor="white", lw=1))
            ax.text(col + 0.5, r + 0.5, label, ha="center", va="center", fontsize=8.5)
        for first, length in runs(boxed_groups(dims), gpus_per_node):
            ax.add_patch(Rectangle((first % gpus_per_node + 0.04, first // gpus_per_node + 0.04),
                                   length - 0.08, 0.92, fill=False, lw=2.2, edgecolor="black"))
        ax.set_xlim(0, gpus_per_node)
        ax.set_ylim(dims.world_size // gpus_per_node, 0)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([i + 0.5 for i in range(dims.world_size // gpus_per_node)])
        ax.set_yticklabels([f"node {i}" for i in range(dims.world_size // gpus_per_node)], fontsize=8)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
