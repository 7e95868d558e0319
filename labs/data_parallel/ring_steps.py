"""Chapter 2: the ring all-reduce step by step, as it ran, and its picture.

`trace` runs `hand_ring.ring_allreduce` itself on N ranks with inputs that name their sender:
every element of rank q's buffer is 2**q, so a chunk's value, summed over the ranks that have
added to it, is a bit mask of those ranks (int64 sums are exact). The ring's `on_step` hook hands
each rank every chunk as it arrives; the trace keeps which chunk it was, whose inputs it holds
and the bytes counted so far (`labs.measure.comm`). Nothing is taken from the algorithm's
description: `draw` pictures the holdings the messages carried, so the picture cannot disagree
with the run. `draw_schemes` sets the naive all-reduce beside the ring, each rank labelled with
the bytes it sent, counted.

    python -m labs.data_parallel.ring_steps --world-size 4 --json
"""
import torch

from labs.data_parallel.hand_ring import ring_allreduce
from labs.launcher import launch
from labs.measure import comm


def trace(rank, world_size, chunk_numel=2):
    """Run the hand ring all-reduce and record what arrives at this rank at each step.

    Returns steps: one dict per step (phase, step, chunk, holds: the ranks whose inputs the
    arrived chunk sums, bytes_sent: counted message bytes this rank sent in that step), the
    chunk bytes, and exact: every element of the result equals the sum over all ranks.
    """
    if world_size > 62:
        raise ValueError(f"the trace names ranks by bits of an int64: at most 62 ranks, got {world_size}.")
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be at least 1, got {chunk_numel}.")
    buf = torch.full((world_size * chunk_numel,), 1 << rank, dtype=torch.int64, device=launch.device())
    steps = []

    def seen(phase, step, chunk, values):
        mask = int(values[0])
        assert bool((values == mask).all()), "a chunk arrived with mixed contributions"
        steps.append({"phase": phase, "step": step, "chunk": chunk,
                      "holds": [q for q in range(world_size) if mask >> q & 1],
                      "bytes_total": tally.bytes_sent})

    with comm.counting() as tally:
        ring_allreduce(buf, on_step=seen)
    before = 0
    for s in steps:   # counted bytes per step, from the running total
        s["bytes_sent"], before = s["bytes_total"] - before, s["bytes_total"]
        del s["bytes_total"]
    return {"rank": rank, "world_size": world_size, "chunk_bytes": chunk_numel * buf.element_size(),
            "steps": steps, "exact": bool((buf == (1 << world_size) - 1).all())}


def holdings(traces):
    """Per step, the ranks whose inputs each rank holds in each chunk: held[t][r][k] (a set).

    Before the first step rank r holds only its own input; a chunk changes only when one arrives.
    """
    n = len(traces)
    state = [[{r} for _ in range(n)] for r in range(n)]
    out = []
    for t in range(len(traces[0]["steps"])):
        state = [[set(c) for c in row] for row in state]
        for r, tr in enumerate(traces):
            s = tr["steps"][t]
            state[r][s["chunk"]] = set(s["holds"])
        out.append(state)
    return out


def draw(traces):
    """The ring's 2(N-1) steps as panels of ranks x chunks, shaded by how many ranks' inputs each
    holds, the chunk that arrived in that step outlined; reduce-scatter on the left, all-gather
    on the right, so that the picture stays legible in a phone's column."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n = len(traces)
    held = holdings(traces)
    steps = traces[0]["steps"]
    fig, axes = plt.subplots(n - 1, 2, figsize=(6.0, 1.9 * (n - 1) + 0.5), squeeze=False)
    cmap = plt.get_cmap("Blues")
    for t, s in enumerate(steps):
        ax = axes[s["step"], 0 if s["phase"] == "reduce-scatter" else 1]
        for r in range(n):
            arrived = traces[r]["steps"][t]["chunk"]
            for k in range(n):
                count = len(held[t][r][k])
                ax.add_patch(Rectangle((k, r), 1, 1, facecolor=cmap(0.15 + 0.75 * count / n),
                                       edgecolor="white", linewidth=1))
                ax.text(k + 0.5, r + 0.5, str(count), ha="center", va="center", fontsize=10,
                        color="white" if count > n / 2 else "black")
            ax.add_patch(Rectangle((arrived, r), 1, 1, fill=False, edgecolor="tab:red", linewidth=2.2))
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_aspect("equal")
        ax.set_xticks([k + 0.5 for k in range(n)], [f"c{k}" for k in range(n)], fontsize=9)
        ax.set_yticks([r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=9)
        ax.tick_params(length=0)
        ax.set_title(f"{s['phase']}, step {s['step'] + 1}", fontsize=10)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(f"Ring all-reduce on {n} ranks: how many ranks' inputs each chunk holds\n"
                 "(red: the chunk that arrived from the left neighbour in that step)", fontsize=10)
    fig.tight_layout()
    return fig


def draw_node_rings(gpus_per_node, nic_bytes_per_s, node_egress_bytes_per_s):
    """A schematic of a ring across two nodes placed node by node: one ring per NIC (NCCL's
    channels), ring i carrying 1/gpus of the buffer and crossing between the nodes on NIC i, so the
    node's egress, all NICs at once, is the ring's W (`labs.formulas.links.ring_bandwidth`)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    g = gpus_per_node
    fig, ax = plt.subplots(figsize=(6.0, 3.9))
    colors = plt.get_cmap("tab10")
    for node, x0 in enumerate((0.0, 3.6)):
        ax.add_patch(Rectangle((x0, -0.95), 2.4, g + 0.85, facecolor="0.96", edgecolor="k"))
        ax.text(x0 + 1.2, g - 0.6, f"node {node}: {g} GPUs, NVLink", ha="center", va="center",
                fontsize=9)
        gpu_x, nic_x = (x0 + 0.15, x0 + 1.6) if node == 0 else (x0 + 1.1, x0 + 0.3)
        for i in range(g):
            y = g - 1.5 - i
            ax.add_patch(Rectangle((gpu_x, y - 0.3), 1.1, 0.6, facecolor="white", edgecolor="0.4"))
            ax.text(gpu_x + 0.55, y, f"GPU {i}", ha="center", va="center", fontsize=8)
            ax.add_patch(Rectangle((nic_x, y - 0.22), 0.5, 0.44, facecolor=colors(i), edgecolor="k"))
            ax.text(nic_x + 0.25, y, "NIC", ha="center", va="center", fontsize=6, color="white")
    for i in range(g):
        y = g - 1.5 - i
        ax.annotate("", (3.9, y + 0.08), (2.1, y + 0.08),
                    arrowprops=dict(arrowstyle="-|>", color=colors(i), lw=1.4))
        ax.annotate("", (2.1, y - 0.08), (3.9, y - 0.08),
                    arrowprops=dict(arrowstyle="-|>", color=colors(i), lw=1.0, ls="--"))
        ax.text(3.0, y + 0.2, f"ring {i}: M/{g}", ha="center", fontsize=6.5, color=colors(i))
    ax.set_title(f"{g} rings, one per NIC: each carries 1/{g} of the gradients at "
                 f"{nic_bytes_per_s / 1e9:.0f} GB/s,\nso a node's egress is {g} x "
                 f"{nic_bytes_per_s / 1e9:.0f} = {node_egress_bytes_per_s / 1e9:.0f} GB/s "
                 "(a schematic)", fontsize=9)
    ax.set_xlim(-0.1, 6.1)
    ax.set_ylim(-1.0, g)
    ax.axis("off")
    fig.tight_layout()
    return fig


def draw_schemes(naive_sent, ring_sent, buffer_bytes):
    """The two all-reduces side by side on N ranks placed on a circle, each rank labelled with the
    bytes it sent (counted messages, one list per scheme): naive, every rank to rank 0 and back;
    ring, each rank to its right neighbour only."""
    import math
    import matplotlib.pyplot as plt

    n = len(ring_sent)
    pos = [(math.sin(2 * math.pi * r / n), math.cos(2 * math.pi * r / n)) for r in range(n)]
    fig, axes = plt.subplots(1, 2, figsize=(6.4, 3.6))
    arrow = dict(arrowstyle="-|>", lw=1.6, shrinkA=17, shrinkB=17, mutation_scale=14)
    for ax, title, sent in ((axes[0], "naive: all to rank 0, and back", naive_sent),
                            (axes[1], "ring: each to its right neighbour", ring_sent)):
        if sent is naive_sent:
            for r in range(1, n):
                ax.annotate("", pos[0], pos[r], arrowprops=dict(arrow, color="tab:orange",
                                                                connectionstyle="arc3,rad=0.15"))
                ax.annotate("", pos[r], pos[0], arrowprops=dict(arrow, color="tab:red",
                                                                connectionstyle="arc3,rad=0.15"))
        else:
            for r in range(n):
                ax.annotate("", pos[(r + 1) % n], pos[r],
                            arrowprops=dict(arrow, color="tab:blue", connectionstyle="arc3,rad=-0.25"))
        for r, (x, y) in enumerate(pos):
            ax.add_patch(plt.Circle((x, y), 0.2, facecolor="0.92", edgecolor="k", zorder=3))
            ax.text(x, y, str(r), ha="center", va="center", fontsize=11, zorder=4)
            ax.text(1.5 * x, 1.42 * y, f"{sent[r] / buffer_bytes:.2g}M", ha="center",
                    va="center", fontsize=10, color="k")
        ax.set_title(title, fontsize=10)
        ax.set_xlim(-1.8, 1.8)
        ax.set_ylim(-1.75, 1.75)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle(f"All-reduce on {n} ranks: bytes each rank sent (counted),\n"
                 f"in units of its buffer M = {buffer_bytes:,} bytes", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("The hand ring all-reduce step by step: what arrives where.", world_size_default=4)
    args = cli.parse(p, argv)
    traces = launch.launch(trace, args.world_size, timeout=args.timeout)
    if traces is None:
        return
    lines = [f"rank {t['rank']}: " + ", ".join(f"{s['phase']} {s['step'] + 1} c{s['chunk']} {s['holds']}"
                                               for s in t["steps"]) for t in traces]
    cli.report({"ranks": traces}, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
