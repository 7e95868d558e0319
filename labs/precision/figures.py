"""Chapter 8's pictures, each drawn from what the lab read or ran.

- `layouts`: the bit layout and the range of FP32, BF16, FP16, E4M3, E5M2 and an MXFP8 block, the
  numbers read from ``torch.finfo`` (`loss_scaling.formats`, `mx_scale`), the block of 32 elements
  sharing one E8M0 scale from the OCP Microscaling specification v1.0 (2023, Table 1).
- `underflow`: a gradient sample against FP16's range, before and after a loss scale.
- `scaler_trace`: the dynamic loss scale per step, the hand scaler beside GradScaler, skips marked.
- `granularity`: FP8 per tensor, per row and per block over several draws (`fp8.matmul_error_seeds`).
- `fp8_gemm`: the scaled FP8 matrix product end to end (tiles and blocks, cast, multiply, promote).
Every figure is 6.4 inches wide, so its 10-point text stays legible in a phone's column.
"""
import math

import torch

from labs.precision import scaling

ROWS = (("FP32", "fp32"), ("BF16", "bf16"), ("FP16", "fp16"), ("FP8 E4M3", "fp8_e4m3"),
        ("FP8 E5M2", "fp8_e5m2"))
COLOURS = {"sign": "0.55", "exponent": "tab:blue", "mantissa": "tab:orange", "scale": "tab:green"}


def mx_scale():
    """The MX block scale's format, E8M0, from ``torch.finfo(torch.float8_e8m0fnu)``: 8 exponent
    bits, no sign, no mantissa, powers of two from 2^-127 to 2^127. Checked by casting: both ends
    survive, and 3 (not a power of two) does not."""
    dtype = torch.float8_e8m0fnu
    fi = torch.finfo(dtype)
    back = lambda v: torch.tensor(v, dtype=torch.float64).to(dtype).double().item()  # noqa: E731
    assert back(fi.max) == fi.max and back(fi.smallest_normal) == fi.smallest_normal and back(3.0) != 3.0
    return {"bits": fi.bits, "exponent_bits": fi.bits, "mantissa_bits": round(-math.log2(fi.eps)),
            "max": fi.max, "smallest": fi.smallest_normal, "block": scaling.MX_BLOCK}


def _bits(ax, y, fields, x0=0.0):
    """Draw one bit per unit from x0: fields [(kind, count), ...]; returns the x after the last."""
    from matplotlib.patches import Rectangle

    x = x0
    for kind, n in fields:
        for _ in range(n):
            ax.add_patch(Rectangle((x, y - 0.35), 1, 0.7, facecolor=COLOURS[kind], edgecolor="white",
                                   linewidth=0.6))
            x += 1
    return x


def layouts(F, mx):
    """Top: each format's sign, exponent and mantissa bits, one box per bit, and an MXFP8 block.
    Bottom: each format's range on a log2 axis, subnormals lighter, from F = `loss_scaling.formats()`
    and mx = `mx_scale()`."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.4), height_ratios=(1.15, 1))
    names = [n for n, _ in ROWS] + ["MXFP8 block"]
    for i, (name, key) in enumerate(ROWS):
        f = F[key]
        fields = [("sign", 1), ("exponent", f["exponent_bits"]), ("mantissa", f["mantissa_bits"])]
        end = _bits(top, -i, fields)
        top.text(end + 0.6, -i, f"1 + {f['exponent_bits']} + {f['mantissa_bits']}", va="center")
    y = -len(ROWS)
    end = _bits(top, y, [("scale", mx["exponent_bits"])])
    end = _bits(top, y, [("sign", 1), ("exponent", F["fp8_e4m3"]["exponent_bits"]),
                         ("mantissa", F["fp8_e4m3"]["mantissa_bits"])], end + 1)
    top.text(end + 0.6, y, f"1 scale per {mx['block']} E4M3", va="center")
    top.set_yticks([-i for i in range(len(names))], names)
    top.set_xlim(0, 44)
    top.set_ylim(-len(names) + 0.4, 0.6)
    top.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        top.spines[side].set_visible(False)
    top.legend(handles=[Patch(color=COLOURS[k], label=k) for k in ("sign", "exponent", "mantissa", "scale")],
               ncol=4, loc="lower center", bbox_to_anchor=(0.45, 1.0), frameon=False)
    # ranges: log2 of the smallest subnormal, the smallest normal and the max
    for i, (name, key) in enumerate(ROWS):
        f = F[key]
        lo, mid, hi = (math.log2(f[k]) for k in ("smallest_subnormal", "smallest_normal", "max"))
        bottom.barh(-i, mid - lo, left=lo, color="tab:blue", alpha=0.35, height=0.6)
        bottom.barh(-i, hi - mid, left=mid, color="tab:blue", height=0.6)
        if f["max"] < 1e6:
            bottom.text(hi + 3, -i, f"max {f['max']:,.0f}", va="center")
        else:  # a bar as wide as the axis: the label inside it
            bottom.text(hi - 3, -i, f"max {f['max']:.1e}", va="center", ha="right", color="white")
    lo, hi = math.log2(mx["smallest"]), math.log2(mx["max"])
    bottom.barh(-len(ROWS), hi - lo, left=lo, color="tab:green", height=0.6)
    bottom.text(0, -len(ROWS), "powers of 2 only", va="center", ha="center", color="white")
    bottom.set_yticks([-i for i in range(len(names))], names[:-1] + ["MX scale\n(E8M0)"])
    bottom.set_xlabel("log2 of the magnitude (light: subnormal)")
    bottom.set_xlim(-155, 135)
    bottom.set_ylim(-len(names) - 0.4, 0.6)
    fig.tight_layout()
    return fig


def underflow(grads, fp16, scale):
    """Histogram of log2 |g| of the gradient sample, as drawn and multiplied by ``scale``, against
    FP16's range (fp16 = `loss_scaling.formats()["fp16"]`): below half its smallest subnormal a
    value becomes zero, above its max infinity."""
    import matplotlib.pyplot as plt

    e = torch.log2(grads.abs()).numpy()
    shift = math.log2(scale)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    zero = math.log2(fp16["smallest_subnormal"]) - 1
    ax.axvspan(-70, zero, color="tab:red", alpha=0.12)
    ax.axvspan(zero, math.log2(fp16["smallest_normal"]), color="0.85")
    ax.axvspan(math.log2(fp16["max"]), 40, color="tab:red", alpha=0.12)
    bins = [b / 2 for b in range(-140, 81)]
    ax.hist(e, bins=bins, color="0.3", alpha=0.7, label="gradients as they are")
    ax.hist(e + shift, bins=bins, color="tab:blue", alpha=0.6, label=f"times S = 2^{shift:.0f}")
    ax.text(-59, ax.get_ylim()[1] * 0.93, "zero in FP16", va="top")
    ax.text(24, ax.get_ylim()[1] * 0.6, "inf", ha="right")
    ax.set_xlim(-60, 25)
    ax.set_xlabel("log2 |gradient|  (grey band: FP16 subnormals)")
    ax.set_ylabel("count")
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


def scaler_trace(trace):
    """log2 S per step for the hand scaler (line) and GradScaler (markers), skipped steps in red,
    from `loss_scaling.scaler_trace`."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    steps = [h["step"] for h in trace["hand"]]
    ax.step(steps, [math.log2(h["scale"]) for h in trace["hand"]], "k-", where="post", label="hand scaler")
    ax.plot(steps, [math.log2(g["scale"]) for g in trace["torch"]], "o", color="tab:blue",
            markerfacecolor="none", label="GradScaler")
    skipped = [h for h in trace["hand"] if h["skipped"]]
    ax.plot([h["step"] for h in skipped], [math.log2(h["scale"]) for h in skipped], "x", color="tab:red",
            markersize=9, mew=2, label="overflow: step skipped")
    ax.set_xlabel("step")
    ax.set_ylabel("log2 S")
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


def granularity(r):
    """Each draw's share of X flushed to zero and error of XW^T per scaling (dots), their median
    (bar), from `fp8.matmul_error_seeds`."""
    import matplotlib.pyplot as plt

    names = ("tensor", "row", "block")
    fig, axes = plt.subplots(1, 2, figsize=(6.4, 3.0))
    for ax, key, title in ((axes[0], "x_zero_fraction", "X flushed to zero, %"),
                           (axes[1], "errors", "error of XW^T, %")):
        for j, g in enumerate(names):
            v = r[key][g]
            ax.bar(j, 100 * v["median"], color="tab:blue", alpha=0.4)
            ax.plot([j] * len(v["each"]), [100 * x for x in v["each"]], "k.", markersize=5)
        ax.set_xticks(range(3), ["tensor", "row", "tile"])
        ax.set_title(title, fontsize=10)
    axes[0].set_xlabel("one scale per")
    axes[1].set_xlabel("one scale per")
    fig.tight_layout()
    return fig


def fp8_gemm(block=None, fmax=None):
    """The scaled FP8 matrix product end to end, as DeepSeek-V3 (section 3.3.2) runs it: top, X's
    1 x 128 tiles and W's 128 x 128 blocks, one scale each, and the K dimension walked 128 at a time;
    bottom, the pipeline for one output entry: scale and cast to E4M3, multiply and sum 128 products
    in the tensor core's short accumulator, divide by the two scales and add into FP32, repeat."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from labs.precision import fp8

    block = block or fp8.BLOCK
    fmax = fmax or scaling.FMAX
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 6.6)
    ax.axis("off")
    # top: the operands, K split into groups of `block`
    for x0, w, h, name, hw, hh, label in ((0.2, 4.4, 1.6, "X (tokens x K)", 1.1, 0.22,
                                           f"1 x {block} tile:\none scale"),
                                          (5.4, 4.4, 1.6, "W (outputs x K)", 1.1, 1.1,
                                           f"{block} x {block}\nblock:\none scale")):
        y0 = 4.6
        ax.add_patch(Rectangle((x0, y0), w, h, facecolor="0.93", edgecolor="0.3"))
        for j in range(1, 4):
            ax.plot([x0 + j * w / 4] * 2, [y0, y0 + h], color="0.6", lw=0.8, ls=":")
        ax.add_patch(Rectangle((x0 + w / 4, y0 + h - hh - 0.1), hw, hh, facecolor="tab:blue", alpha=0.7))
        ax.text(x0, y0 + h + 0.12, name, fontsize=10, weight="bold")
        ax.text(x0 + w / 4 + hw + 0.1, y0 + h - hh / 2 - 0.1, label, fontsize=9, va="center")
        ax.text(x0 + w / 2, y0 - 0.25, f"K, in groups of {block}", fontsize=9, ha="center")
    # bottom: the pipeline for one group of K
    boxes = ((0.1, f"one scale\nper group:\n{fmax:g} / amax"),
             (2.1, f"cast x scale\nto E4M3,\nclamp {fmax:g}"),
             (4.1, f"tensor core:\n{block} products\nin ~14 bits"),
             (6.1, "divide by\nboth scales,\nadd in FP32"), (8.1, "Y = XW^T,\nwritten\nas BF16"))
    for x, text in boxes:
        ax.add_patch(Rectangle((x, 1.2), 1.8, 1.9, facecolor="white", edgecolor="0.3"))
        ax.text(x + 0.9, 2.15, text, fontsize=9, ha="center", va="center")
    for x in (1.9, 3.9, 5.9, 7.9):
        ax.add_patch(FancyArrowPatch((x, 2.15), (x + 0.2, 2.15), arrowstyle="-|>", mutation_scale=10))
    ax.add_patch(FancyArrowPatch((7.0, 1.2), (5.0, 1.2), connectionstyle="arc3,rad=-0.5",
                                 arrowstyle="-|>", mutation_scale=10, color="tab:red"))
    ax.text(6.0, 0.2, f"next {block} of K (FP32 promotion every {block})", fontsize=9, ha="center",
            color="tab:red")
    ax.text(5.0, 3.75, "for each output entry, K is summed one group at a time:", fontsize=9,
            ha="center", style="italic")
    fig.tight_layout()
    return fig
