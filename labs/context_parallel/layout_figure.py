"""Chapter 6: the picture of the causal attention split over cp ranks, contiguous and zig-zag.

Each panel is the causal score matrix (queries down, keys across) of one sequence, every entry a
query attends to coloured by the rank that holds the query, from `methods.layout`: the chunks
the ring attention lab hands each rank. Under each panel, the work each rank computed in the
lab's run (tiles of (s/cp)^2 per head, counted by the kernel). Panels stacked in pairs, so the
picture stays legible in a phone's column.
"""
from labs.context_parallel import methods

COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
           "tab:olive")


def owner_grid(cp, seq_len, order):
    """grid[q][k]: the rank holding query q where q attends to k (k <= q), else -1."""
    owner = [None] * seq_len
    for rank, chunks in enumerate(methods.layout(cp, seq_len, order)):
        for start, length in chunks:
            for q in range(start, start + length):
                owner[q] = rank
    return [[owner[q] if k <= q else -1 for k in range(seq_len)] for q in range(seq_len)]


def draw(cp, seq_len, work):
    """``work``: {order: tiles per rank, measured}, for "contiguous" and "zigzag"."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    orders = ("contiguous", "zigzag")
    cmap = ListedColormap(["white"] + [COLOURS[r % len(COLOURS)] for r in range(cp)])
    fig, axes = plt.subplots(2, 2, figsize=(6.2, 5.6), height_ratios=(3, 1.4))
    for col, order in enumerate(orders):
        ax = axes[0, col]
        grid = [[v + 1 for v in row] for row in owner_grid(cp, seq_len, order)]
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=cp, interpolation="nearest")
        pieces = cp if order == "contiguous" else 2 * cp
        ticks = [i * seq_len // pieces - 0.5 for i in range(pieces + 1)]
        for t in ticks:
            ax.axhline(t, color="0.6", lw=0.5)
            ax.axvline(t, color="0.6", lw=0.5)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel("keys")
        ax.set_ylabel("queries")
        ax.set_title(f"{'zig-zag' if order == 'zigzag' else order} split, s = {seq_len}", fontsize=10)
        bars = axes[1, col]
        tiles = [float(x) for x in work[order]]
        bars.bar(range(cp), tiles, color=[COLOURS[r % len(COLOURS)] for r in range(cp)])
        bars.axhline(sum(tiles) / cp, color="k", ls=":", lw=1)
        bars.set_xticks(range(cp), [f"rank {r}" for r in range(cp)], fontsize=9)
        bars.set_ylim(0, 1.15 * max(max(float(x) for x in w) for w in work.values()))
        bars.set_title(f"work, measured: max/mean {max(tiles) * cp / sum(tiles):.2f}", fontsize=10)
    axes[1, 0].set_ylabel("tiles")
    fig.tight_layout()
    return fig
