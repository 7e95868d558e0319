"""`labs.measure.report`: the stable float statements and the glue that needs no book toolchain."""
import pytest

from labs.measure import report


def _captured(monkeypatch, module, attribute, call):
    """The (bundle, metadata) that ``call`` hands to IPython's display through ``module.attribute``."""
    seen = []
    monkeypatch.setattr(module, attribute, lambda obj, raw, metadata: seen.append((obj, metadata)))
    call()
    return seen


@pytest.mark.parametrize("value", [3, 0.125, "text", [1, 2]])
@pytest.mark.parametrize("display", [True, False])
def test_glue_writes_what_myst_nb_writes(monkeypatch, value, display):
    """The book reads glue outputs with myst-nb, so ours must be byte-for-byte myst-nb's."""
    import IPython.display
    myst_glue = pytest.importorskip("myst_nb.ext.glue")
    theirs = _captured(monkeypatch, myst_glue, "ipy_display", lambda: myst_glue.glue("x", value, display))
    ours = _captured(monkeypatch, IPython.display, "display", lambda: report.glue("x", value, display))
    assert ours == theirs and len(ours) == 1
    assert report.GLUE_PREFIX == myst_glue.GLUE_PREFIX


def test_a_glued_figure_is_shown_as_myst_nb_shows_it_and_closed(monkeypatch):
    """A chapter page pastes the PNG its notebook page renders: a figure is glued shown, as its PNG
    (what myst-nb's glue writes for it), and closed so that the kernel does not show it twice."""
    import IPython.display
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.core.pylabtools import select_figure_formats
    myst_glue = pytest.importorskip("myst_nb.ext.glue")
    select_figure_formats(InteractiveShell.instance(), {"png"})  # what the inline backend sets up
    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    theirs = _captured(monkeypatch, myst_glue, "ipy_display", lambda: myst_glue.glue("f", fig, True))
    ours = _captured(monkeypatch, IPython.display, "display", lambda: report.glue("f", fig))
    assert ours == theirs and "image/png" in ours[0][0]
    assert not plt.fignum_exists(fig.number)
    with pytest.raises(ValueError, match="glued shown"):
        report.glue("f", plt.figure(), display=False)
    plt.close("all")


def test_glue_does_not_import_the_book_toolchain():
    import subprocess
    import sys
    code = ("import sys; from labs.measure import report; report.glue('x', 1);"
            "bad = [m for m in ('docutils', 'sphinx', 'myst_nb') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_stable_refuses_a_value_near_a_rounding_boundary():
    assert report.stable(0.1234, 2, 1e-4) == 0.12
    with pytest.raises(AssertionError, match="fewer digits"):
        report.stable(0.125, 2, 1e-3)


def test_below_fails_when_the_value_is_not_below():
    assert report.below(1e-7, 1e-6) == "< 1e-06"
    with pytest.raises(AssertionError):
        report.below(2e-6, 1e-6)


def test_no_notebook_imports_the_book_toolchain():
    """A box that only runs the notebooks has no myst-nb: every notebook glues through labs.measure.report."""
    import glob
    import json
    import os
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
    notebooks = sorted(glob.glob(os.path.join(root, "*.ipynb")))
    assert notebooks
    for path in notebooks:
        code = "".join("".join(c["source"]) for c in json.load(open(path))["cells"]
                       if c["cell_type"] == "code")
        assert "myst_nb" not in code and "sphinx" not in code, f"{path} imports the book toolchain"
