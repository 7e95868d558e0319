"""The notebook regression still catches real drift.

The committed notebooks state floating-point results only to the precision their assertions
guarantee (`labs/measure/report.py`), so nbval passes on any CPU and under any `ATEN_CPU_CAPABILITY`. These
tests check the other side: when an exact quantity changes (a byte count off by one fp32 element, a
schedule with one action moved, a glued integer) nbval fails, and fails on that cell alone. Each test
takes a committed notebook up to the cell under test, changes one exact value in that cell's
committed output (what a lab that drifted would produce) and runs nbval on the copy.

No sanitizer is configured, so nothing can mask such a value; a test here fails if one is added
that does.
"""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(REPO, "notebooks")) if f.endswith(".ipynb"))
# cell tags with which nbval does not compare a cell's output (timings) or does not run the cell
UNCHECKED = {"nbval-ignore-output", "nbval-skip"}


def _truncated(notebook, marker):
    """The notebook's cells up to the code cell whose source contains ``marker``, and that cell's
    index among code cells (nbval names items "Cell K" by that index)."""
    nb = json.load(open(os.path.join(REPO, "notebooks", notebook)))
    code_index = -1
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            code_index += 1
            if marker in "".join(cell["source"]):
                nb["cells"] = nb["cells"][:i + 1]
                return nb, cell, code_index
    raise AssertionError(f"no code cell of {notebook} contains {marker!r}")


def _nbval(nb, tmp_path):
    path = tmp_path / "perturbed.ipynb"
    path.write_text(json.dumps(nb))
    # the repository first, and whatever else the caller had on the path (a GPU box keeps its extra
    # packages, nbval among them, under .box/ through PYTHONPATH: see tools/box_setup.py)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--nbval", str(path), "--nbval-current-env",
                           "--nbval-cell-timeout=300", "-p", "no:cacheprovider", "-q", "-rf"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def _perturb_output(cell, mime, pattern, replace):
    """Apply one substitution to the first output of ``mime`` that ``pattern`` matches."""
    for out in cell["outputs"]:
        text = out.get("text") if mime == "stream" else out.get("data", {}).get(mime)
        if text is None:
            continue
        text = "".join(text)
        new, count = re.subn(pattern, replace, text, count=1)
        if count:
            if mime == "stream":
                out["text"] = new
            else:
                out["data"][mime] = new
            return
    raise AssertionError(f"no {mime} output matches {pattern!r}")


def _assert_only_cell_fails(code, output, index):
    assert code == 1, output
    failed = re.findall(r"FAILED \S+::Cell (\d+)", output)
    assert failed == [str(index)], output
    # every earlier cell ran and matched (pytest omits "0 passed")
    assert re.search(rf"1 failed, {index} passed" if index else r"1 failed in", output), output


def test_a_byte_count_off_by_one_element_fails(tmp_path):
    # The ring's counted bytes per rank at N = 4: the last rank "sends" one fp32 element more.
    nb, cell, index = _truncated("02_data_parallel.ipynb", "launch.spawn(ra.compare")
    _perturb_output(cell, "text/markdown", r"(\| 4 \| ring \|[^\n]*?\[\d+, \d+, \d+, )(\d+)\]",
                    lambda m: f"{m.group(1)}{int(m.group(2)) + 4}]")
    _assert_only_cell_fails(*_nbval(nb, tmp_path), index)


def test_a_glued_integer_off_by_one_element_fails(tmp_path):
    # The glued per-rank ring bytes that the chapter's prose quotes.
    nb, cell, index = _truncated("02_data_parallel.ipynb", "launch.spawn(ra.compare")
    record = "application/papermill.record/text/plain"
    glued = [o for o in cell["outputs"]
             if o.get("metadata", {}).get("scrapbook", {}).get("name") == "ring_bytes_n4"]
    assert len(glued) == 1
    glued[0]["data"][record] = str(int(glued[0]["data"][record]) + 4)
    _assert_only_cell_fails(*_nbval(nb, tmp_path), index)


def test_a_schedule_with_one_action_moved_fails(tmp_path):
    # 1F1B on stage 0 of 4: the first backward moved one slot later (F3 F4 B0 instead of F3 B0 F4).
    nb, cell, index = _truncated("05_pipeline_parallel.ipynb", "schedules.build(")
    _perturb_output(cell, "text/markdown", r"(\| 1F1B \| 0 \| F0 F1 F2 F3) B0 F4", r"\1 F4 B0")
    _assert_only_cell_fails(*_nbval(nb, tmp_path), index)


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_no_checked_output_prints_a_float_at_full_precision(notebook):
    """A float printed with all its digits (like 0.030286453664302826) changes with the CPU.

    Exact values that are floats (16.0, 0.2727272727272727 from integer counts) are allowed only in
    glue records of cells that compute them from integers; a long run of digits in printed text or
    tables means an unrounded float reached a checked output.
    """
    nb = json.load(open(os.path.join(REPO, "notebooks", notebook)))
    long_float = re.compile(r"\d\.\d{9,}")
    for cell in nb["cells"]:
        source = "".join(cell.get("source", ""))
        if cell["cell_type"] != "code" or UNCHECKED & set(cell["metadata"].get("tags", [])):
            continue
        for out in cell["outputs"]:
            texts = [out.get("text", "")] + [out.get("data", {}).get(k, "")
                                             for k in ("text/plain", "text/markdown")]
            for text in texts:
                text = "".join(text)
                assert not long_float.search(text), (notebook, source[:80], long_float.search(text).group(0))


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_nbval_markers_are_cell_tags(notebook):
    """Cells whose output nbval must not compare carry the tag `nbval-ignore-output`, which the site
    does not show; an in-source comment such as `# NBVAL_IGNORE_OUTPUT` is visible on every page."""
    nb = json.load(open(os.path.join(REPO, "notebooks", notebook)))
    for cell in nb["cells"]:
        source = "".join(cell.get("source", ""))
        assert not re.search(r"#\s*NBVAL_", source), (notebook, source[:80])


WIDTH = 88  # characters of printed output a lab page shows on one line; longer lines are cut off
RICH = ("text/markdown", "text/html", "image/png", "application/papermill.record/text/plain",
        "application/vnd.jupyter.widget-view+json")


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_no_printed_line_is_cut_off_on_the_page(notebook):
    """Printed output (streams, and plain text where nothing richer is shown) fits the page's width,
    in every cell, timings included: print less, split the line, or show a Markdown table."""
    nb = json.load(open(os.path.join(REPO, "notebooks", notebook)))
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        for out in cell["outputs"]:
            data = out.get("data", {})
            text = out.get("text", "") if out["output_type"] == "stream" else \
                "" if any(k in data for k in RICH) else data.get("text/plain", "")
            for line in "".join(text).splitlines():
                assert len(line) <= WIDTH, (notebook, "".join(cell["source"])[:80], line)


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_widgets_stay_out_of_every_executed_path(notebook):
    """ipywidgets need a running kernel. A cell that uses them is run by neither the book build
    (tag skip-execution) nor nbval (tag nbval-skip) and keeps no output; the notebook keeps no
    widget state, which would make the static page load widget scripts from a CDN."""
    nb = json.load(open(os.path.join(REPO, "notebooks", notebook)))
    assert "widgets" not in nb["metadata"], notebook
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        if "ipywidgets" in source or "interact(" in source:
            tags = set(cell["metadata"].get("tags", []))
            assert {"skip-execution", "nbval-skip"} <= tags, (notebook, source[:80])
            assert cell["outputs"] == [], (notebook, source[:80])
        for out in cell["outputs"]:
            widget = "application/vnd.jupyter.widget-view+json"
            assert widget not in out.get("data", {}), (notebook, source[:80])
