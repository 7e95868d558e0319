"""Chapter 4: the picture of the Megatron MLP split, drawn from the split the lab runs.

Z = GeLU(X A) B on tp ranks: A's columns and B's rows are cut where `megatron.shard_rows` cuts
them (the function `parallelize_mlp` slices the weights with), each rank's slice in its own
colour, to scale; the all-reduce that g makes is labelled with the payload the lab read from the
tensor handed to the collective. Two rows, stacked, so the picture stays legible in a phone's
column: the column-parallel product, then the row-parallel one and its all-reduce.
"""
from labs.tensor_parallel import megatron

COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _matrix(ax, x, y, w, h, label, shape, bands=(), vertical=True, colour="0.8"):
    """A w x h box at (x, y) (top left), split into coloured bands [(start, stop, colour), ...] of
    its columns (``vertical``) or rows, with its name inside and its shape below."""
    from matplotlib.patches import Rectangle

    if not bands:
        ax.add_patch(Rectangle((x, y - h), w, h, facecolor=colour, edgecolor="k", linewidth=1))
    for a, b, c in bands:
        if vertical:
            ax.add_patch(Rectangle((x + a * w, y - h), (b - a) * w, h, facecolor=c, edgecolor="k"))
        else:
            ax.add_patch(Rectangle((x, y - b * h), w, (b - a) * h, facecolor=c, edgecolor="k"))
    ax.text(x + w / 2, y - h - 0.12, f"{label}\n{shape}", ha="center", va="top", fontsize=9)


def draw(tp, hidden, tokens, payload_bytes):
    """The split at ``tp`` for an MLP of width ``hidden`` on ``tokens`` = b * s tokens."""
    import matplotlib.pyplot as plt

    width = 4 * hidden
    cuts = [megatron.shard_rows(width, tp, r) for r in range(tp)]
    bands = [(int(c[0]) / width, (int(c[-1]) + 1) / width, COLOURS[r % len(COLOURS)])
             for r, c in enumerate(cuts)]
    u = 1 / hidden                         # drawing units per element: h is 1 unit
    th, aw, bh = tokens * u, width * u, width * u
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.2), height_ratios=(1.4, 4.2))
    # column-parallel: X A = [X A_1, ..., X A_tp], GeLU on each slice alone
    _matrix(top, 0, 1, 1, th, "X", f"{tokens} × {hidden}", colour="0.75")
    top.text(1.3, 0.5, "×", fontsize=14, ha="center", va="center")
    _matrix(top, 1.6, 1, aw, 1, "A, split by columns", f"{hidden} × {width}", bands)
    top.text(1.9 + aw, 0.5, "→", fontsize=14, ha="center", va="center")
    _matrix(top, 2.2 + aw, 1, aw, th, "Y = GeLU(XA)", f"{tokens} × {width}", bands)
    top.set_title("Column-parallel: rank i computes Y_i = GeLU(X A_i), no communication",
                  fontsize=10)
    # row-parallel: Y B = sum_i Y_i B_i, the partial sums added by g's all-reduce
    _matrix(bottom, 0, bh, aw, th, "Y", f"{tokens} × {width}", bands)
    bottom.text(aw + 0.3, bh - th / 2, "×", fontsize=14, ha="center", va="center")
    _matrix(bottom, aw + 0.6, bh, 1, bh, "B, split\nby rows", f"{width} × {hidden}", bands,
            vertical=False)
    bottom.text(aw + 1.9, bh - th / 2, "→", fontsize=14, ha="center", va="center")
    for r, (_, _, colour) in enumerate(bands):
        y = bh - r * (th + 0.75)
        _matrix(bottom, aw + 2.3, y, 1, th, f"Y_{r} B_{r}", "partial", colour=colour)
    below = bh - (tp - 1) * (th + 0.75) - th - 0.6   # under the last partial sum's label
    z_top = below - 0.8
    bottom.annotate("", xy=(aw + 2.8, z_top + 0.05), xytext=(aw + 2.8, below),
                    arrowprops=dict(arrowstyle="->", lw=1.5))
    bottom.text(aw + 2.95, (below + z_top) / 2, "g", fontsize=10, va="center")
    _matrix(bottom, aw + 2.3, z_top, 1, th, "Z = Σ Y_i B_i", "on every rank", colour="0.75")
    bottom.text(aw + 2.8, z_top - th - 0.6,
                f"g: one all-reduce\nof {payload_bytes:,} bytes (b·s·h,\nread from the tensor)",
                ha="center", va="top", fontsize=9)
    bottom.set_title("Row-parallel: rank i computes Y_i B_i; g adds the partial sums",
                     fontsize=10)
    for ax, (w, h) in ((top, (3.6 + 2 * aw, 1.6)), (bottom, (aw + 4.0, bh + 0.2))):
        ax.set_xlim(-0.1, w)
        ax.set_ylim(-0.9 if ax is top else min(-0.6, z_top - th - 1.4), h if ax is bottom else 1.15)
        ax.set_aspect("equal")
        ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, label=f"rank {r}") for r, (_, _, c) in enumerate(bands)]
    fig.legend(handles=handles, loc="upper center", ncol=tp, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig
