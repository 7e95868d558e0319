"""The GPU command's results, figure by figure: what every section returns.

A figure is a dict: value, unit, kind ("measured" or "formula"), and where it has one the formula
beside it (text and value). A section that needs CUDA by nature reports "skipped: <reason>" on a
CPU, and a kernel the build or the GPU refuses is "refused: <reason>": never a number. The
sections (`labs.gpu.memory`, `labs.gpu.speed`, `labs.gpu.dcp`) import this module; the command
that runs them (`labs.gpu.record`) imports the sections.
"""


def figure(value, unit, kind="measured", formula=None, formula_value=None, **extra):
    """One figure of the results file; ``formula`` is the text, ``formula_value`` its number."""
    out = {"value": value, "unit": unit, "kind": kind}
    if formula is not None:
        out.update(formula=formula, formula_value=formula_value)
    out.update(extra)
    return out


def skipped(reason):
    return f"skipped: {reason}"


def refused(reason):
    return f"refused: {' '.join(str(reason).split())[:400]}"
