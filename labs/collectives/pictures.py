"""Chapter 10's pictures: each algorithm's messages, drawn from the rounds a lab run logged.

`recursive.Rounds` logs, per exchange, what a rank sent (dst, bytes) and received (src, bytes).
A rank's exchanges are numbered locally; `align` places each on the common round in which it
happened: the i-th message from s to d and the i-th receive from s on d are one message, so both
exchanges share a round, and a rank's next exchange comes at least one round after its last.
`draw` then puts ranks in rows and rounds in columns, one arrow per message, its width the bytes
as a share of the full buffer M, coloured by whether it stays inside a node. `ring_blocks` replays
the ring all-reduce's index rule block by block, and `draw_blocks` shows what each rank holds.
"""
from collections import defaultdict

from matplotlib.patches import FancyArrowPatch


def _matches(schedule):
    """Per (rank, exchange), the (peer, peer's exchange) it shares a message with."""
    sent, got = defaultdict(list), defaultdict(list)     # (src, dst) -> [(rank, exchange index)]
    for r, log in enumerate(schedule):
        for k, ex in enumerate(log):
            for d, _ in ex["sends"]:
                sent[r, d].append(k)
            for s, _ in ex["recvs"]:
                got[s, r].append(k)
    pairs = defaultdict(list)
    for (s, d), ks in sent.items():
        for ks_, kd in zip(ks, got[s, d]):
            pairs[s, ks_].append((d, kd))
            pairs[d, kd].append((s, ks_))
    return pairs


def align(schedule):
    """Per rank, the common round of each of its exchanges (as early as the messages allow)."""
    pairs = _matches(schedule)
    t = [list(range(len(log))) for log in schedule]
    changed = True
    while changed:
        changed = False
        for r, log in enumerate(schedule):
            for k in range(len(log)):
                want = max([t[r][k - 1] + 1 if k else 0] + [t[p][kp] for p, kp in pairs[r, k]])
                if want > t[r][k]:
                    t[r][k], changed = want, True
    return t


def draw(ax, schedule, nbytes, title, node_size=None):
    """Ranks as rows, rounds as columns; an arrow per message, width ~ bytes / M; red if it crosses
    nodes of ``node_size`` ranks. Returns the number of rounds drawn."""
    t, p = align(schedule), len(schedule)
    rounds = 1 + max((max(ts) for ts in t if ts), default=0)
    for r in range(p):
        ax.axhline(r, color="0.85", lw=0.8, zorder=0)
    for r, log in enumerate(schedule):
        for k, ex in enumerate(log):
            for d, n in ex["sends"]:
                across = node_size and r // node_size != d // node_size
                ax.add_patch(FancyArrowPatch((t[r][k] + 0.1, r), (t[r][k] + 0.85, d),
                                             arrowstyle="-|>", mutation_scale=9,
                                             lw=0.6 + 3.0 * n / nbytes,
                                             color="tab:red" if across else "tab:blue"))
    ax.set_xlim(-0.1, rounds)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=8)
    ax.set_xticks([k + 0.5 for k in range(rounds)], [str(k + 1) for k in range(rounds)], fontsize=8)
    ax.set_xlabel("round", fontsize=8)
    ax.set_title(title, fontsize=9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return rounds


def ring_blocks(p):
    """The ring all-reduce block by block: per step (the start, then each of its 2(p-1) rounds),
    held[i][b], how many ranks' inputs rank i's copy of block b sums, and sent[i], the block rank i
    passed right in that round. The index rule of `algorithms.ring_reduce_scatter` (round s: rank i
    sends its partial of block (i-1-s) mod p and adds its input to block (i-2-s) mod p from the left)
    and of `algorithms.ring_all_gather` (round s: rank i passes block (i-s) mod p on), replayed on
    counts instead of tensors."""
    held, steps = [[1] * p for _ in range(p)], []
    steps.append(([row[:] for row in held], [None] * p))
    for s in range(p - 1):
        sent = [(i - 1 - s) % p for i in range(p)]
        held = [[held[(i - 1) % p][b] + 1 if b == sent[(i - 1) % p] else held[i][b] for b in range(p)]
                for i in range(p)]
        steps.append(([row[:] for row in held], sent))
    for s in range(p - 1):
        sent = [(i - s) % p for i in range(p)]
        held = [[held[(i - 1) % p][b] if b == sent[(i - 1) % p] else held[i][b] for b in range(p)]
                for i in range(p)]
        steps.append(([row[:] for row in held], sent))
    return steps


def draw_blocks(axes, steps, titles):
    """One panel per step: ranks as rows, blocks as columns, each cell the number of inputs summed
    (dark: all p); a black frame on the block each rank received in that round, from its left."""
    from matplotlib.patches import Rectangle
    p = len(steps[0][0])
    for ax, (held, sent), title in zip(axes, steps, titles):
        ax.imshow(held, cmap="Blues", vmin=0, vmax=p + 1)
        for i in range(p):
            for b in range(p):
                ax.text(b, i, str(held[i][b]), ha="center", va="center", fontsize=8,
                        color="white" if held[i][b] == p else "black")
            if sent[i] is not None:
                got = sent[(i - 1) % p]
                ax.add_patch(Rectangle((got - 0.5, i - 0.5), 1, 1, fill=False, lw=2, color="black"))
        ax.set_xticks(range(p), [str(b) for b in range(p)], fontsize=7)
        ax.set_yticks(range(p), [str(i) for i in range(p)], fontsize=7)
        ax.set_title(title, fontsize=8)
