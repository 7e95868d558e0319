"""Chapter 6: the pictures of what is split, drawn from the lab's layouts and runs.

- `ring_steps_figure`: the sequence's chunks over cp ranks (zig-zag) and, step by step, the causal
  score tiles each rank computes while the K, V blocks travel one rank along the ring; the owner of
  the block each rank holds at each step is the one the lab's ring recorded.
- `split_figure`: a tokens-by-columns matrix split among ranks by rows (tokens) or by columns
  (heads), before and after a collective: sequence parallelism's f_sp and g_sp, and Ulysses' all-to-all.

Every panel stays legible in a phone's column (390 px): few tiles, large labels.
"""
from labs.context_parallel import methods
from labs.context_parallel.layout_figure import COLOURS


def _colour(rank):
    return COLOURS[rank % len(COLOURS)]


def ring_steps_figure(cp, seq_len, owners, order="zigzag"):
    """``owners[rank][step]``: the rank whose K, V block ``rank`` holds at ``step`` (from the run)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    table = methods.layout(cp, seq_len, order)
    chunk = table[0][0][1]
    n = seq_len // chunk                                            # chunks of the sequence
    holder = {start // chunk: r for r, chunks in enumerate(table) for start, _ in chunks}
    fig = plt.figure(figsize=(4.8, 6.0))
    grid = fig.add_gridspec(3, 2, height_ratios=(0.35, 3, 3), hspace=0.6, wspace=0.2)
    strip = fig.add_subplot(grid[0, :])
    for x in range(n):
        strip.add_patch(Rectangle((x, 0), 1, 1, color=_colour(holder[x]), ec="white"))
        strip.text(x + 0.5, 0.5, str(holder[x]), ha="center", va="center", color="white", fontsize=10)
    strip.set_xlim(0, n)
    strip.set_ylim(0, 1)
    strip.axis("off")
    strip.set_title(f"the sequence, {order.replace('zigzag', 'zig-zag')} split: chunk = rank",
                    fontsize=10)
    for step in range(cp):
        ax = fig.add_subplot(grid[1 + step // 2, step % 2])
        for qc in range(n):
            for kc in range(qc + 1):                                # causal: keys up to the query
                r, k_owner = holder[qc], holder[kc]
                now = owners[r][step] == k_owner
                done = any(owners[r][j] == k_owner for j in range(step))
                face = _colour(r) if now else ("0.82" if done else "0.97")
                ax.add_patch(Rectangle((kc, qc), 1, 1, color=face, ec="white", lw=0.8))
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel("keys", fontsize=10)
        ax.set_ylabel("queries", fontsize=10)
        ax.set_title(f"step {step}: K, V of\nrank r - {step}" if step else
                     "step 0: its own\nK, V", fontsize=10)
    return fig


def _matrix(ax, ranks, by, owner_of, title, labels=None):
    """A ranks x ranks grid of blocks (tokens down, columns across), block (i, j) coloured by
    ``owner_of(i, j)``; ``labels[i][j]`` written in it."""
    from matplotlib.patches import Rectangle

    for i in range(ranks):
        for j in range(ranks):
            r = owner_of(i, j)
            ax.add_patch(Rectangle((j, i), 1, 1, color=_colour(r), ec="white", lw=1.5))
            text = labels[i][j] if labels else str(r)
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", color="white", fontsize=10)
    ax.set_xlim(0, ranks)
    ax.set_ylim(ranks, 0)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_ylabel("tokens", fontsize=10)
    ax.set_xlabel(by, fontsize=10)
    ax.set_title(title, fontsize=10)


def split_figure(ranks, kind):
    """``kind`` "sp": sequence parallelism's f (all-gather) and g (reduce-scatter) around a
    tensor-parallel region; "ulysses": the all-to-all from the sequence split to the head split
    (each block labelled sender -> receiver)."""
    import matplotlib.pyplot as plt

    if kind == "ulysses":
        fig, axes = plt.subplots(1, 2, figsize=(4.8, 3.0))
        sends = [[f"{i}>{j}" if i != j else "kept" for j in range(ranks)] for i in range(ranks)]
        _matrix(axes[0], ranks, "heads", lambda i, j: i, "before: token block\ni>j: to rank j", sends)
        _matrix(axes[1], ranks, "heads", lambda i, j: j, "after: head group")
        fig.suptitle(f"Ulysses' all-to-all, cp = {ranks}", fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.93))
        return fig
    fig, axes = plt.subplots(1, 3, figsize=(5.0, 2.9))
    _matrix(axes[0], ranks, "hidden", lambda i, j: i, "LayerNorm:\ns/t tokens")
    _matrix(axes[1], ranks, "columns", lambda i, j: j, "attention, MLP:\n1/t of columns")
    _matrix(axes[2], ranks, "hidden", lambda i, j: i, "dropout, add:\ns/t tokens")
    for x, text in ((0.35, "$f_\\mathrm{sp}$: all-gather\n(back: reduce-\nscatter)"),
                    (0.68, "$g_\\mathrm{sp}$: reduce-\nscatter (back:\nall-gather)")):
        fig.text(x, 0.02, text, ha="center", fontsize=9)
    fig.suptitle(f"Sequence parallelism, t = {ranks}: colour = rank", fontsize=10)
    fig.tight_layout(rect=(0, 0.2, 1, 0.95))
    return fig
