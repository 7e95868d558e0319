"""A token's trip through an expert-parallel MoE layer, drawn: route, dispatch all-to-all, the
experts, combine all-to-all (GShard, Lepikhin et al. 2020, section 2; Switch, Fedus et al. 2021,
figure 3). A schematic with 2 ranks, 4 experts and top-1, so that every row can be followed; the
rows a rank receives are computed from the routing drawn, the way `moe` sorts them (by expert,
then by source rank and token). Beside it, one token's node-deduplicating dispatch against the flat
all-to-all (DeepSeek-V3 technical report, section 3.2.2), its rows per link counted as
`node_dispatch.derived_rows` counts them."""
import matplotlib.pyplot as plt

# rank r's tokens t(4r)..t(4r+3) choose these experts; experts 0, 1 live on rank 0, 2, 3 on rank 1
CHOICE = (0, 2, 3, 1, 2, 0, 3, 2)
EXPERTS, RANKS, PER_RANK = 4, 2, 4
GAP = 6  # x offset of rank 1's lane


def received(choice=CHOICE, experts=EXPERTS, ranks=RANKS):
    """For each rank, the tokens it receives in dispatch, sorted by expert then token."""
    per = experts // ranks
    return [sorted((e, t) for t, e in enumerate(choice) if e // per == r) for r in range(ranks)]


def trip_rows(choice=CHOICE):
    """(rows sent across ranks, rows kept) by the dispatch of ``choice``; combine mirrors it."""
    per = EXPERTS // RANKS
    across = sum(1 for t, e in enumerate(choice) if t // PER_RANK != e // per)
    return across, len(choice) - across


def _box(ax, x, y, text, colour, hatch=None):
    ax.add_patch(plt.Rectangle((x - 0.42, y - 0.3), 0.84, 0.6, facecolor=colour, edgecolor="k",
                               lw=0.8, hatch=hatch, alpha=0.9))
    ax.text(x, y, text, ha="center", va="center", fontsize=8.5)


def _arrow(ax, x0, y0, x1, y1, across):
    ax.annotate("", (x1, y1 + 0.32), (x0, y0 - 0.32),
                arrowprops=dict(arrowstyle="->", lw=1.4 if across else 0.8,
                                color="C3" if across else "0.55"))


def draw(choice=CHOICE):
    """The figure: four rows, one per stage, the two ranks side by side."""
    colours = [f"C{e}" for e in (0, 1, 2, 4)]
    recv = received(choice)
    home = {t: (t // PER_RANK) * GAP + t % PER_RANK for t in range(len(choice))}
    slot = {t: r * GAP + i for r, rows in enumerate(recv) for i, (_, t) in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(5.6, 6.0))
    ys = {"route": 4.2, "dispatch": 2.9, "expert": 1.6, "combine": 0.3}
    for t, e in enumerate(choice):
        _box(ax, home[t], ys["route"], f"t{t}", colours[e])
        _box(ax, slot[t], ys["dispatch"], f"t{t}", colours[e])
        _box(ax, slot[t], ys["expert"], f"e{e}", colours[e])
        _box(ax, home[t], ys["combine"], f"y{t}", colours[e])
        across = home[t] // GAP != slot[t] // GAP
        _arrow(ax, home[t], ys["route"], slot[t], ys["dispatch"], across)
        _arrow(ax, slot[t], ys["expert"], home[t], ys["combine"], across)
        _arrow(ax, slot[t], ys["dispatch"], slot[t], ys["expert"], False)
    labels = {"route": "1. route: the router picks each token's expert (colour)",
              "dispatch": "2. dispatch all-to-all: each row to its expert's rank",
              "expert": "3. each expert runs on the rows it received",
              "combine": "4. combine all-to-all: back to the token's rank, \u00d7 gate"}
    for key, y in ys.items():
        ax.text(GAP - 1, y + 0.42, labels[key], ha="center", va="bottom", fontsize=8.5,
                bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
    for r in range(RANKS):
        per = EXPERTS // RANKS
        ax.text(r * GAP + 2, 5.05, f"rank {r} (experts e{r * per}, e{r * per + 1})",
                ha="center", fontsize=9, weight="bold")
    ax.axvline(GAP - 1, color="0.7", ls=":", lw=1)
    ax.plot([], [], color="C3", lw=1.4, label="crosses ranks")
    ax.plot([], [], color="0.55", lw=0.8, label="stays on its rank")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize=8.5, frameon=False)
    ax.set_xlim(-0.6, GAP + 4.6)
    ax.set_ylim(-0.2, 5.3)
    ax.axis("off")
    fig.tight_layout()
    return fig


# DeepSeek-V3's node-deduplicating dispatch (technical report, section 3.2.2), drawn for one token
# on rank 0 of a 2-node grid of 2 ranks each: its top-4 experts live on these ranks.
NODE_CHOICE, NODE_SRC, RANKS_PER_NODE, NODE_RANKS = (1, 2, 2, 3), 0, 2, 4


def node_rows(dests=NODE_CHOICE, src=NODE_SRC, per_node=RANKS_PER_NODE):
    """The rows one token's dispatch sends, per link, as `node_dispatch.derived_rows` counts them:
    flat, one row per expert on another rank; once per node, one row per other node to the rank with
    the same in-node index there, then one per other rank of that node hosting its experts.
    Returns {"flat": [(from, to), ...], "node": [...]} and the counts across nodes and inside."""
    flat = [(src, d) for d in dests if d != src]
    node = []
    for m in sorted({d // per_node for d in dests}):
        hub = m * per_node + src % per_node                        # where the token lands on node m
        if hub != src:
            node.append((src, hub))
        node += [(hub, d) for d in sorted({d for d in dests if d // per_node == m} - {hub})]
    count = {k: {"ib": sum(a // per_node != b // per_node for a, b in v),
                 "nvlink": sum(a // per_node == b // per_node for a, b in v)} for k, v in
             (("flat", flat), ("node", node))}
    return {"flat": flat, "node": node}, count


def draw_node_dispatch(dests=NODE_CHOICE, src=NODE_SRC, per_node=RANKS_PER_NODE, ranks=NODE_RANKS):
    """Two panels, the flat all-to-all above the node-deduplicating dispatch: the rows of one token
    (on rank ``src``) to the ranks of its experts, red across nodes (InfiniBand), grey inside
    (NVLink)."""
    sends, count = node_rows(dests, src, per_node)
    xs = [r + 1.2 * (r // per_node) for r in range(ranks)]        # a gap between the nodes
    fig, axes = plt.subplots(2, 1, figsize=(5.6, 5.2))
    titles = {"flat": f"flat all-to-all: one row per expert; {count['flat']['ib']} rows cross nodes",
              "node": f"once per node: {count['node']['ib']} row crosses, NVLink fans it out"}
    for ax, key in zip(axes, ("flat", "node")):
        for m in range(ranks // per_node):
            x0, x1 = xs[m * per_node] - 0.5, xs[(m + 1) * per_node - 1] + 0.5
            ax.add_patch(plt.Rectangle((x0, -0.55), x1 - x0, 1.1, facecolor="0.95", edgecolor="0.5", lw=0.8))
            ax.text((x0 + x1) / 2, -0.8, f"node {m}: NVLink inside", ha="center", va="top", fontsize=8.5)
        for r in range(ranks):
            hits = sum(d == r for d in dests)
            what = f"{hits} expert{'s' * (hits > 1)}" if hits else ""
            label = f"rank {r}\n" + ("the token" if r == src else what)
            _box(ax, xs[r], 0, label, "C1" if r == src else "C0" if hits else "white")
        seen = {}
        for a, b in sends[key]:
            across = a // per_node != b // per_node
            seen[(a, b)] = seen.get((a, b), 0) + 1
            rad = -0.35 - 0.25 * (seen[(a, b)] - 1)
            ax.annotate("", (xs[b], 0.32), (xs[a], 0.32),
                        arrowprops=dict(arrowstyle="->", lw=1.6 if across else 1.0,
                                        color="C3" if across else "0.45", connectionstyle=f"arc3,rad={rad}"))
        ax.set_title(titles[key], fontsize=9.5)
        ax.set_xlim(-0.7, xs[-1] + 0.7)
        ax.set_ylim(-1.3, 1.9)
        ax.axis("off")
    axes[1].plot([], [], color="C3", lw=1.6, label="across nodes (InfiniBand)")
    axes[1].plot([], [], color="0.45", lw=1.0, label="inside a node (NVLink)")
    axes[1].legend(loc="lower center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8.5, frameon=False)
    fig.tight_layout()
    return fig
