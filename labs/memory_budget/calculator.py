"""Chapter 1, the memory calculator over a grid of settings: the lab page's tables and plot.

`grid` and `markdown_table` evaluate `calculate`, that is `labs.formulas.memory.budget`, over the
sliders' values. The live calculator, on the site (in the reader's browser) and in JupyterLab, is the
form `labs.formulas.form_memory` on the same function; `show` and `sliders` are the older slider
view of it.

    # one setting, from a shell
    python -m labs.memory_budget.budget --model 70B --world-size 64 --tp 8 --zero-stage 1
"""
import itertools
import textwrap

from labs.memory_budget import budget

# the sliders' values, and where they start
SLIDERS = {"model": list(budget.MODELS), "world_size": [8, 16, 32, 64, 128, 256, 512, 1024],
           "tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8, 16], "zero_stage": [0, 1, 2, 3],
           "recompute": ["none", "selective", "full"], "attention": ["materialized", "flash"],
           "seq": [2048, 4096, 8192], "micro_batch": [1, 2, 4]}
DEFAULTS = {"model": "70B", "world_size": 64, "tp": 8, "pp": 1, "zero_stage": 1, "recompute": "selective",
            "attention": "flash", "seq": 4096, "micro_batch": 1}


def calculate(**settings):
    """`budget.budget` at the sliders' settings (the others at DEFAULTS; mixed-precision Adam;
    sequence parallelism whenever tp > 1). Degrees that do not divide the world size or the model
    give {"error": the reason} instead of raising, so a grid can show them."""
    unknown = set(settings) - set(SLIDERS)
    if unknown:
        raise ValueError(f"no slider named {', '.join(sorted(unknown))}; the sliders are "
                         f"{', '.join(SLIDERS)}.")
    s = {**DEFAULTS, **settings}
    try:
        return budget.budget(s["model"], s["world_size"], s["tp"], s["pp"], s["zero_stage"], "mixed",
                             s["seq"], s["micro_batch"], s["recompute"], sp=s["tp"] > 1,
                             attention=s["attention"])
    except ValueError as exc:
        return {"error": str(exc)}


def show(**settings):
    """The sliders' display: GiB per GPU, part by part, and whether it fits in one GPU."""
    r = calculate(**settings)
    if "error" in r:
        print(textwrap.fill(r["error"], 80))
        return
    for part, gib in r["gib_per_device"].items():
        print(f"{part:16s} {gib:8.1f} GiB")
    print(f"{'fits' if r['fits'] else 'does not fit'} in {r['gpu_gib']} GiB")


def grid(**axes):
    """`calculate` over every combination of the values given per slider: {values: result}, the
    values in the order the sliders were given, e.g. grid(tp=[1, 8], pp=[1, 2]) has key (8, 2)."""
    return {values: calculate(**dict(zip(axes, values))) for values in itertools.product(*axes.values())}


def cell(r):
    """One table cell: GiB per GPU, marked ✗ above the GPU's capacity; — for an invalid split."""
    if "error" in r:
        return "—"
    total = f"{r['gib_per_device']['total']:.1f}"
    return total if r["fits"] else f"{total} ✗"


def markdown_table(rows, column, **fixed):
    """The calculator as a Markdown table: one row per combination of ``rows`` ({slider: values}),
    one column per value of ``column`` ((slider, values)), every other slider at ``fixed`` or its
    default. Cells: GiB per GPU (`cell`)."""
    name, values = column
    results = grid(**rows, **{name: values}, **{k: [v] for k, v in fixed.items()})
    head = [f"| {' | '.join(rows)} | " + " | ".join(f"{name} {v}" for v in values) + " |",
            "|---" * (len(rows) + len(values)) + "|"]
    body = []
    for combo in itertools.product(*rows.values()):
        cells = [cell(results[combo + (v,) + tuple(fixed.values())]) for v in values]
        body.append(f"| {' | '.join(map(str, combo))} | " + " | ".join(cells) + " |")
    return "\n".join(head + body)


def sliders():
    """One control per slider, at DEFAULTS, for ``ipywidgets.interact(show, **sliders())``: a slider
    for the numbers, buttons for the names. Needs ipywidgets and a running kernel (JupyterLab)."""
    import ipywidgets as widgets
    return {name: (widgets.SelectionSlider if isinstance(values[0], int) else widgets.ToggleButtons)(
                options=values, value=DEFAULTS[name], description=name)
            for name, values in SLIDERS.items()}
