"""Chapter 4: the Megatron MLP in two forms, all-reduce and all-gather + reduce-scatter, run and drawn.

A ring all-reduce is a reduce-scatter followed by an all-gather (Patarasuk and Yuan 2009). Move
the all-gather from the end of one block to the start of the next and the block reads, in the
sharded-matmul notation of Austin et al. (2025, *How to Scale Your Model*, Part 3; Part 5 names
B, D, F):

    X[(bs)_tp, h] -> all-gather -> X[bs, h] . W_in[h, (h_ff)_tp] -> Y[bs, (h_ff)_tp]
                 . W_out[(h_ff)_tp, h] -> Z[bs, h]{partial} -> reduce-scatter -> Z[(bs)_tp, h]

(b s tokens, h_ff the MLP width; a subscript tp marks the dimension split over the tp ranks.)
Between blocks each rank then holds only its b s / tp tokens: sequence parallelism (chapter 6).

`check` runs both forms of the forward on the same weights beside the unsharded MLP and counts
each collective through `labs.measure.comm` (payloads read from the tensors handed to it; bytes
sent are the ring formula). `draw_forms` draws the two forms from that run; `draw_async` draws the
collective matmul's ring (chapter 15 measures it): at step k rank i multiplies the chunk of rank
(i - k) mod t while it passes that chunk on, so t - 1 transfers hide under t matmuls.
"""
import copy

import torch

from labs.launcher import launch
from labs.measure import comm
from labs.tensor_parallel import blocks, megatron


def check(rank, world_size, b=2, s=8, hidden=48):
    """The MLP's forward in the all-reduce form and in the all-gather + reduce-scatter form, on the
    same sharded weights: each beside the unsharded MLP (max abs error), each collective counted."""
    dev, t = launch.device(), world_size
    full = blocks._full_block("mlp", blocks.config(hidden=hidden)).to(dev)
    x = torch.randn(b * s, hidden, generator=torch.Generator().manual_seed(1)).to(dev)  # (T, h)
    with torch.no_grad():
        ref = full(x)
        mlp = megatron.parallelize_mlp(copy.deepcopy(full), None)
        with comm.counting() as ar:                     # g's all-reduce of the partial sums
            z_ar = mlp(x)
        rows = x.size(0) // t                           # this rank's T/tp tokens
        mine = slice(rank * rows, (rank + 1) * rows)
        with comm.counting() as agrs:
            gathered = torch.empty_like(x)
            comm.all_gather(gathered, x[mine].contiguous())
            partial = torch.nn.functional.linear(
                mlp.act(torch.nn.functional.linear(gathered, mlp.fc.weight, mlp.fc.bias)), mlp.proj.weight)
            z_mine = torch.empty(rows, hidden, device=dev)
            comm.reduce_scatter(z_mine, partial.contiguous())
            z_mine += mlp.proj.bias
    return {"error_allreduce": (z_ar - ref).abs().max().item(),
            "error_ag_rs": (z_mine - ref[mine]).abs().max().item(),
            "tokens": x.size(0), "hidden": hidden, "width": mlp.fc.weight.size(0) * t,
            "allreduce": ar.as_dict()["ops"], "ag_rs": agrs.as_dict()["ops"]}


def forms(rank, world_size, shapes, b=2, s=8, hidden=48):
    """`blocks.message_bytes` for ``shapes`` and `check`, in one job (one process start)."""
    return {"payloads": blocks.message_bytes(rank, world_size, shapes),
            "forms": check(rank, world_size, b, s, hidden)}


def _box(ax, x, y, w, h, text, colour, sub=""):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x - w / 2, y - h), w, h, facecolor=colour, edgecolor="k"))
    ax.text(x, y - h / 2, text, ha="center", va="center", fontsize=10)
    if sub:
        ax.text(x + w / 2 + 0.08, y - h / 2, sub, ha="left", va="center", fontsize=9)


def _arrow(ax, x, y0, y1, label, colour="k"):
    ax.annotate("", xy=(x, y1), xytext=(x, y0), arrowprops=dict(arrowstyle="->", lw=1.4, color=colour))
    ax.text(x + 0.1, (y0 + y1) / 2, label, ha="left", va="center", fontsize=9, color=colour)


def draw_forms(result, tp):
    """Two columns, one per form, each a block's forward from top to bottom: a box per tensor one
    rank holds, its height the tokens it covers (T or T/tp), the collectives in red with the payload
    read from the run and the ring formula's bytes sent."""
    import matplotlib.pyplot as plt

    T, h, F = result["tokens"], result["hidden"], result["width"]
    ar, agrs = result["allreduce"]["all_reduce"], result["ag_rs"]
    fig, axes = plt.subplots(1, 2, figsize=(6.4, 5.6))
    full, shard = 0.9, 0.9 / tp
    grey, blue, red = "0.8", "tab:blue", "tab:red"

    def column(ax, title, steps):
        y = 0
        for kind, a, b_ in steps:
            if kind == "box":
                hgt = shard if "/tp" in a[1].split(",")[0] else full
                _box(ax, 0.42, y, 0.56, hgt, a[0], b_, a[1])
                y -= hgt
            else:
                _arrow(ax, 0.42, y - 0.02, y - 0.55, a, b_)
                y -= 0.57
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, 1.45)
        ax.set_ylim(y - 0.1, 0.05)
        ax.axis("off")

    sent_ar = ar["formula_bytes_sent"]
    column(axes[0], "all-reduce form", [
        ("box", ("X", "[bs, h]"), grey), ("arrow", "· W_in[h, h_ff/tp]", "k"),
        ("box", ("Y_i", "[bs, h_ff/tp]"), blue), ("arrow", "· W_out[h_ff/tp, h]", "k"),
        ("box", ("Z_i partial", "[bs, h]"), blue),
        ("arrow", f"all-reduce\n{ar['payloads'][0]:,} B in\n{sent_ar:,} B sent", red),
        ("box", ("Z", "[bs, h]"), grey)])
    ag, rs = agrs["all_gather"], agrs["reduce_scatter"]
    column(axes[1], "all-gather + reduce-scatter", [
        ("box", ("X_i", "[bs/tp, h]"), grey),
        ("arrow", f"all-gather\n{ag['formula_bytes_sent']:,} B sent", red),
        ("box", ("X", "[bs, h]"), grey), ("arrow", "· W_in, · W_out", "k"),
        ("box", ("Z_i partial", "[bs, h]"), blue),
        ("arrow", f"reduce-scatter\n{rs['formula_bytes_sent']:,} B sent", red),
        ("box", ("Z_i", "[bs/tp, h]"), grey)])
    fig.suptitle(f"One MLP forward on one rank, tp = {tp}: bs = {T} tokens, h = {h}, h_ff = {F}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def draw_async(t=4, x=3.0, mm=2.0):
    """The collective matmul on rank 0 of ``t``, a chunk's transfer ``x`` and matmul ``mm`` (any
    time unit): above, each transfer waited for before the matmul; below, each transfer under the
    matmul of the chunk already held. Chunk c at step k is (0 - k) mod t, the ring's order."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    rows = {"no overlap": 1.6, "collective matmul": 0.0}
    end = {}
    for name, y in rows.items():
        clock = 0.0
        for k in range(t):
            c = (0 - k) % t
            if name == "no overlap" and k > 0:       # wait for chunk c, then multiply it
                ax.add_patch(Rectangle((clock, y + 0.55), x, 0.45, facecolor="tab:red", edgecolor="k"))
                clock += x
            start = clock
            ax.add_patch(Rectangle((start, y), mm, 0.45, facecolor="tab:blue", edgecolor="k"))
            ax.text(start + mm / 2, y + 0.22, f"X_{c}", ha="center", va="center", fontsize=9, color="w")
            if name == "collective matmul" and k < t - 1:   # pass chunk c on while multiplying it
                ax.add_patch(Rectangle((start, y + 0.55), x, 0.45, facecolor="tab:red", edgecolor="k",
                                       alpha=0.6))
                clock = start + max(mm, x)
            else:
                clock = start + mm
        end[name] = clock
        ax.text(-0.2, y + 0.5, name, ha="right", va="center", fontsize=10)
        ax.text(clock + 0.2, y + 0.22, f"ends at {clock:g}", ha="left", va="center", fontsize=9)
    ax.set_xlim(-5.2, max(end.values()) + 3.2)
    ax.set_xticks(range(0, int(max(end.values())) + 1, 5))
    ax.set_ylim(-0.8, 2.8)
    ax.set_yticks([])
    ax.set_xlabel(f"time (a transfer takes {x:g}, a matmul {mm:g} units)")
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    handles = [Rectangle((0, 0), 1, 1, color="tab:blue", label="matmul of chunk X_c"),
               Rectangle((0, 0), 1, 1, color="tab:red", label="transfer of a chunk")]
    ax.legend(handles=handles, loc="lower right", fontsize=9, ncol=2, frameon=False,
              bbox_to_anchor=(1, -0.02))
    fig.tight_layout()
    return fig, end
