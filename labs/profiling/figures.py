"""Chapter 15: per-rank timelines drawn from the analysis (matplotlib), the pictures of the chapter.

Each rank gets two lanes on one clock: its own thread (compute, exposed communication, waiting
for a peer, stalled on input; blank is idle) and, just below, its communication in flight. What
lies under compute in the lower lane is hidden; what lies under red is exposed.
"""
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

COLORS = {"compute": "tab:blue", "exposed": "tab:red", "peer_wait": "0.65", "input": "tab:purple",
          "comm": "tab:orange"}
NAMES = {"compute": "compute", "exposed": "exposed communication", "peer_wait": "waiting for a peer",
         "input": "waiting for input", "comm": "communication in flight"}


def _bars(ax, intervals, y, height, color, t0):
    spans = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in intervals]
    if spans:
        ax.broken_barh(spans, (y, height), facecolors=color, linewidth=0)


def draw(ax, per_rank, step=0, title=None, t0=None):
    """One step of every rank: ``per_rank`` is `analysis.analyze`'s result. Milliseconds from the
    earliest rank's step start (all ranks of a run share one clock on one machine)."""
    rows = [ranks[step] for ranks in per_rank]
    t0 = min(r["start_us"] for r in rows) if t0 is None else t0
    used = set()
    for rank, row in enumerate(rows):
        y = rank * 1.6
        for kind in ("compute", "exposed", "peer_wait", "input"):
            if row["intervals"].get(kind):
                used.add(kind)
                _bars(ax, row["intervals"][kind], y, 0.9, COLORS[kind], t0)
        if row["intervals"]["comm"]:
            used.add("comm")
            _bars(ax, row["intervals"]["comm"], y + 0.95, 0.35, COLORS["comm"], t0)
    ax.set_yticks([rank * 1.6 + 0.6 for rank in range(len(rows))], [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlim(0, max((r["start_us"] - t0) / 1e3 + r["step_s"] * 1e3 for r in rows))
    if title:
        ax.set_title(title, fontsize=9)
    return used


def figure(panels, step=0, width=6.5):
    """Stacked timelines: ``panels`` is a list of (title, per_rank) drawn one under the other."""
    heights = [0.55 * len(per_rank) + 0.45 for _, per_rank in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, sum(heights) + 0.9),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    used = set()
    for ax, (title, per_rank) in zip(axes[:, 0], panels):
        used |= draw(ax, per_rank, step, title)
        ax.tick_params(labelsize=8)
    axes[-1, 0].set_xlabel("ms since the step began", fontsize=8)
    handles = [Patch(color=COLORS[k], label=NAMES[k]) for k in COLORS if k in used]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))   # half an inch for the legend
    return fig


# A made-up step of one rank (ms): the key to the timelines. (kind, start, end) on the rank's
# thread, blank is idle; the communication in flight runs from IN_FLIGHT[0] to IN_FLIGHT[1].
TOY = [("input", 0, 10), ("compute", 10, 40), ("compute", 50, 75), ("exposed", 75, 90),
       ("peer_wait", 90, 100)]
TOY_IN_FLIGHT = (50, 90)


def toy_terms(spans=TOY, flight=TOY_IN_FLIGHT, step=100):
    """The five terms of the made-up step and its overlap fraction, from its spans."""
    t = {k: sum(b - a for kind, a, b in spans if kind == k) for k in ("compute", "exposed", "peer_wait",
                                                                        "input")}
    t["idle"] = step - sum(t.values())
    t["in_flight"] = flight[1] - flight[0]
    t["hidden"] = sum(max(0, min(b, flight[1]) - max(a, flight[0])) for k, a, b in spans if k == "compute")
    t["overlap_fraction"] = t["hidden"] / t["in_flight"]
    return t


def schematic(spans=TOY, flight=TOY_IN_FLIGHT, step=100):
    """One made-up rank step with each stretch named, and its overlap fraction: the key."""
    t = toy_terms(spans, flight, step)
    fig, ax = plt.subplots(figsize=(6.4, 2.4))
    label = {"compute": "compute", "exposed": "exposed", "peer_wait": "peer\nwait", "input": "input"}
    for kind, a, b in spans:
        ax.broken_barh([(a, b - a)], (0, 1), facecolors=COLORS[kind], linewidth=0)
        dark = kind in ("compute", "exposed", "input")
        ax.text((a + b) / 2, 0.5, label[kind], ha="center", va="center", fontsize=10,
                color="white" if dark else "black")
    busy = sorted((a, b) for _, a, b in spans)
    for (_, b), (a, _) in zip(busy, busy[1:] + [(step, step)]):
        if a > b:
            ax.text((a + b) / 2, 0.5, "idle", ha="center", va="center", fontsize=10)
    ax.broken_barh([(flight[0], flight[1] - flight[0])], (1.15, 0.45), facecolors=COLORS["comm"])
    ax.text(sum(flight) / 2, 1.375, "in flight", ha="center", va="center", fontsize=10)
    hid = (flight[0], min(flight[1], max(b for k, a, b in spans if k == "compute")))
    ax.annotate("", (hid[0], 1.75), (hid[1], 1.75), arrowprops={"arrowstyle": "<->"})
    ax.text(sum(hid) / 2, 1.85, "hidden", ha="center", va="top", fontsize=10)
    ax.set_yticks([0.5, 1.375], ["rank's\nthread", "its comm."], fontsize=10)
    ax.set_ylim(2.3, -0.1)
    ax.set_xlim(0, step)
    ax.set_xlabel("ms since the step began (a made-up step)", fontsize=10)
    ax.tick_params(labelsize=10)
    ax.set_title(f"overlap fraction = hidden / in flight = {t['hidden']:g} / {t['in_flight']:g}"
                 f" = {t['overlap_fraction']:.3f}", fontsize=10)
    fig.tight_layout()
    return fig
