"""Chapter 5: the picture of a pipeline schedule, drawn from the timeline the executor recorded.

`executor` records every action a stage ran with its start and end on the logical clock that
travels with the messages (F = 1, B = 2; with the backward split F = B = W = 1). `gantt` draws
those events, one row per stage and one bar per action labelled with its micro-batch, so the
picture is the run, not the schedule's description. `draw` makes one figure per schedule, sized
for a phone's column; `x_max` puts several schedules on one time scale.
"""

# F, B, W in blue, orange, green; an interleaved schedule's chunk 1 in a lighter shade of its kind
SHADES = {("F", 0): "tab:blue", ("F", 1): "lightskyblue", ("B", 0): "tab:orange",
          ("B", 1): "navajowhite", ("W", 0): "tab:green", ("W", 1): "lightgreen"}
NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


def _kind(action):
    """('F', 0) for 'F3', ('B', 1) for 'B3.1': the kind of action and its chunk."""
    return action[0], int(action.split(".")[1]) if "." in action else 0


def gantt(ax, events, p, v=1, fontsize=8):
    """One row per stage, one bar per action, labelled with its micro-batch; with ``v`` > 1
    chunks per stage, chunk 1 in a lighter shade. Returns legend handles for the kinds drawn."""
    from matplotlib.patches import Patch

    for s, evs in enumerate(events):
        for e in evs:
            kind, chunk = _kind(e["action"])
            micro = e["action"][1:].split(".")[0]
            ax.barh(s, e["end"] - e["start"], left=e["start"], color=SHADES[kind, chunk],
                    edgecolor="white", height=0.82)
            ax.text((e["start"] + e["end"]) / 2, s, micro, ha="center", va="center",
                    fontsize=fontsize, color="black" if chunk else "white")
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    kinds = sorted({_kind(e["action"]) for evs in events for e in evs}, key=list(SHADES).index)
    return [Patch(color=SHADES[k], label=NAMES[k[0]] + (f", chunk {k[1]}" if v > 1 else ""))
            for k in kinds]


def draw(events, title, p, v=1, x_max=None, width=6.4, rows=1):
    """One schedule's executed timeline as its own figure, its legend under the time axis.

    ``rows`` > 1 cuts the time axis into that many consecutive spans, stacked: an interleaved
    schedule's half-length actions then stay wide enough to label in a phone's column."""
    import math

    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(width, (0.42 * p + 0.55) * rows + 0.95),
                             squeeze=False)
    end = x_max or max(e["end"] for evs in events for e in evs)
    span = math.ceil(end / rows)
    for k, ax in enumerate(axes[:, 0]):
        handles = gantt(ax, events, p, v)
        ax.set_xlim(k * span, (k + 1) * span)
        for t in ax.texts:
            t.set_clip_on(True)
    axes[-1, 0].set_xlabel("work units (the logical clock the messages carry)")
    axes[0, 0].set_title(title, fontsize=10)
    axes[-1, 0].legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.42 * 3 / (p + 1.3)),
                       ncol=min(len(handles), 3 if v == 1 else 2), frameon=False, fontsize=9)
    fig.tight_layout()
    return fig
