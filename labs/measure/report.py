"""How a notebook states a floating-point result so that its committed output is true on any machine.

nbval re-runs every notebook and compares each output with the committed one. Exact quantities
(bytes, message counts, schedules, bubble fractions in work units, bytes per parameter) are printed
as they are: any change in them is real drift and must fail. A floating-point result (an error, a
loss, a drift) changes in its last bits with the CPU's vector width (`ATEN_CPU_CAPABILITY`), the
thread count and the torch build, so its committed output states only what the notebook's assertion
guarantees:

    below(err, 1e-6)         asserts err < 1e-6 and returns "< 1e-06"
    stable(loss, 4, 1e-5)    rounds to 4 decimals, after checking that a change of up to 1e-5
                             (the spread across machines) cannot move the rounded value

`stable` refuses a value that sits too close to a rounding boundary, so a figure that another CPU
would print differently fails here, on the machine that records the notebook, with the advice to
print fewer digits.
"""
import math


def below(value, bound):
    """Assert ``value < bound`` and return the statement that holds on every machine.

    ``bound`` must itself be exact (a constant, or a formula of constants), never a measured value.
    """
    if not value < bound:
        raise AssertionError(f"{value!r} is not below {bound:g}")
    return f"< {bound:g}"


def stable(value, digits, spread):
    """``value`` rounded to ``digits`` decimals, which any value within ``spread`` of it shares."""
    value = float(value)
    scaled = value * 10**digits
    # distance to the rounding boundary, in units of the last digit
    margin = abs(scaled - math.floor(scaled) - 0.5)
    if margin * 10**-digits <= spread:
        raise AssertionError(f"{value!r} is within {spread:g} of a rounding boundary at {digits} decimals: "
                             f"print it with fewer digits.")
    return round(value, digits)


def stable_list(values, digits, spread):
    """`stable` for each of ``values``."""
    return [stable(v, digits, spread) for v in values]


# myst-nb's glue marks a display output with this prefix when the value is stored but not shown.
GLUE_PREFIX = "application/papermill.record/"


def glue(name, value, display=True):
    """Store ``value`` in the cell's output under ``name`` for the book's {glue} roles.

    The same output as ``myst_nb.glue``, written here because importing myst-nb imports Sphinx and
    docutils: a GPU box that only runs the notebooks (nbval) needs none of the book's toolchain.

    A matplotlib figure is stored as its PNG, shown in the notebook, and closed (so the kernel
    does not show it a second time). It must be shown: a chapter page pastes the image file the
    notebook page renders (``{glue:figure}`` with ``:doc:``, tools/glue_figure.py), and nbval
    skips a shown PNG but would compare a hidden one byte for byte, which no other machine's
    fonts and rounding reproduce.
    """
    from IPython.core.formatters import format_display_data
    from IPython.display import display as show

    figure = type(value).__module__.startswith("matplotlib.") and hasattr(value, "savefig")
    if figure and not display:
        raise ValueError(f"glue({name!r}, figure, display=False): a figure is glued shown, so "
                         "that the chapter page can paste the image and nbval skips its PNG.")
    bundle, metadata = format_display_data(value)
    if figure and "image/png" not in bundle:
        raise ValueError(f"glue({name!r}, figure): no PNG of it; run the notebook in a Jupyter "
                         "kernel with matplotlib's inline backend.")
    prefix = "" if display else GLUE_PREFIX
    metadata["scrapbook"] = {"name": name, "mime_prefix": prefix}
    show({prefix + mime: data for mime, data in bundle.items()}, raw=True, metadata=metadata)
    if figure:
        import matplotlib.pyplot as plt
        plt.close(value)
