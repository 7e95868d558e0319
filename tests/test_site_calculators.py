"""The site's calculators: the Python bundled for the browser, the pinned Pyodide, the HTML answer.

- `tools/core_bundle.core_files` follows every import of `labs` from the forms, function-level ones
  included, so a module the browser would miss cannot be left out of `labs-core.zip`;
- `tools/pyodide_dist` refuses a tarball whose sha512 is not the pinned one, and says what to run
  when npm is missing;
- `forms.to_html` shows the numbers and summary of `forms.text`, for every form, on the values the
  browser check uses.
"""
import html.parser
import io
import os
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_calculators  # noqa: E402
import core_bundle  # noqa: E402
import pyodide_dist  # noqa: E402
from labs.formulas import forms  # noqa: E402


def write(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


TREE = {
    "labs/__init__.py": "",
    "labs/dims.py": "import math\n",
    "labs/formulas/__init__.py": "",
    "labs/formulas/forms.py": "from . import schedules\n",
    "labs/formulas/schedules.py": "def check():\n    from labs.measure import exercises\n",
    "labs/measure/__init__.py": "",
    "labs/measure/exercises.py": "import textwrap\n",
    "labs/measure/memory.py": "import torch\n",
    "labs/model.py": "import torch\n",
}


def test_the_closure_follows_relative_and_function_level_imports(tmp_path):
    write(tmp_path, TREE)
    assert core_bundle.core_files(str(tmp_path)) == [
        "labs/__init__.py", "labs/dims.py", "labs/formulas/__init__.py", "labs/formulas/forms.py",
        "labs/formulas/schedules.py", "labs/measure/__init__.py", "labs/measure/exercises.py"]


def test_a_planted_import_shows_up(tmp_path):
    write(tmp_path, dict(TREE, **{"labs/formulas/forms.py": "def f():\n    import labs.model\n"}))
    assert "labs/model.py" in core_bundle.core_files(str(tmp_path))
    write(tmp_path, dict(TREE, **{"labs/dims.py": "from labs.measure import memory\n"}))
    assert "labs/measure/memory.py" in core_bundle.core_files(str(tmp_path))


def test_an_import_without_a_file_is_an_error(tmp_path):
    write(tmp_path, dict(TREE, **{"labs/formulas/forms.py": "import labs.nowhere\n"}))
    with pytest.raises(ValueError, match="labs.nowhere"):
        core_bundle.core_files(str(tmp_path))


def test_the_repository_closure_is_closed_and_zipped(tmp_path):
    files = core_bundle.core_files()
    assert {"labs/__init__.py", "labs/dims.py", "labs/formulas/forms.py", "labs/formulas/schedules.py"} \
        <= set(files)
    for rel in files:
        for module in core_bundle.imported_modules(os.path.join(ROOT, rel)):
            path = module.replace(".", "/")
            assert f"{path}.py" in files or f"{path}/__init__.py" in files, (rel, module)
    zipped = tmp_path / "core.zip"
    core_bundle.write_zip(str(zipped))
    first = zipped.read_bytes()
    assert zipfile.ZipFile(zipped).namelist() == files
    core_bundle.write_zip(str(zipped))
    assert zipped.read_bytes() == first  # the same sources, the same bytes


def tarball(files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("package/" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_the_pinned_integrity_refuses_a_corrupted_tarball(tmp_path):
    good = tarball({name: name.encode() for name in pyodide_dist.RUNTIME})
    pinned = pyodide_dist.integrity_of(good)
    (tmp_path / "pyodide-0.0.1.tgz").write_bytes(good)
    folder = pyodide_dist.unpack(str(tmp_path), "0.0.1", pinned)
    assert sorted(os.listdir(folder)) == sorted(pyodide_dist.RUNTIME + (".integrity",))
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 1
    (tmp_path / "pyodide-0.0.1.tgz").write_bytes(bytes(bad))
    with pytest.raises(pyodide_dist.PyodideError, match="pinned sha512"):
        pyodide_dist.unpack(str(tmp_path), "0.0.1", pinned)
    with pytest.raises(pyodide_dist.PyodideError):
        pyodide_dist.verify(good, pyodide_dist.INTEGRITY)


def test_the_cached_tarball_is_the_pinned_one():
    path = pyodide_dist.tarball_path()
    if not os.path.isfile(path):
        pytest.skip("Pyodide is not fetched on this machine (python tools/pyodide_dist.py)")
    with open(path, "rb") as f:
        pyodide_dist.verify(f.read())


def test_without_npm_one_sentence_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setattr(pyodide_dist.shutil, "which", lambda name: None)
    with pytest.raises(pyodide_dist.PyodideError, match="npm is not installed.*tools/pyodide_dist.py"):
        pyodide_dist.fetch(str(tmp_path))


class Visible(html.parser.HTMLParser):
    """The text a reader sees, the chart (an SVG) left out; the summary paragraph on its own."""

    def __init__(self):
        super().__init__()
        self.text, self.summary, self.stack = [], [], []

    def handle_starttag(self, tag, attrs):
        self.stack.append((tag, dict(attrs).get("class", "")))

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if any(tag == "svg" or "dtm-chart" in cls for tag, cls in self.stack):
            return
        self.text.append(data)
        if any("dtm-summary" in cls for _, cls in self.stack):
            self.summary.append(data)


@pytest.mark.parametrize("name", sorted(forms.FORMS))
def test_the_html_answer_shows_the_text_answer(name):
    bad = check_calculators.bad(name)
    for values in check_calculators.cases(name) + ([bad] if bad else []):
        result = forms.answer(name, values)
        seen = Visible()
        seen.feed(forms.to_html(result))
        said = forms.text(result)
        assert check_calculators.numbers(" ".join(seen.text)) == check_calculators.numbers(said), values
        if result["ok"]:
            assert "".join(seen.summary) == result["summary"]
        else:
            assert "".join(seen.text) == result["error"]
