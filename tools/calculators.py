"""Sphinx extension (loaded by _config.yml): the book's calculators answer in the reader's browser.

A page embeds a calculator with a raw HTML block naming a form of `labs.formulas.forms.FORMS`:

    ```{raw} html
    <div class="dtm-calculator" data-form="bubble"></div>
    ```

On such a page (and only there) `_static/calculators.js` and `calculators.css` are added; the
script loads Pyodide from the site's own `_static/pyodide/`, unpacks `_static/labs-core.zip` (the
forms and the closure of their `labs` imports, tools/core_bundle.py) and runs `forms.spec`,
`forms.answer` and `forms.to_html`: the same Python the labs and the tests run, with no server and
no network. When the build starts, Pyodide comes from npm, pinned and checked
(tools/pyodide_dist.py); without it the build fails with one sentence saying what to run, rather
than ship calculators that cannot load. When it finishes, the run-time files, the zip and the two
assets are copied into `_build/html/_static/`. `tools/check_site.py` (tools/check_calculators.py)
checks every calculator in Chromium against CPython.
"""
import hashlib
import os
import shutil
import sys
import tempfile

from sphinx.errors import ExtensionError

TOOLS = os.path.dirname(os.path.abspath(__file__))
if TOOLS not in sys.path:  # a local extension is imported with tools/ on sys.path; keep it so
    sys.path.insert(0, TOOLS)
import core_bundle  # noqa: E402
import pyodide_dist  # noqa: E402

ASSETS = os.path.join(TOOLS, "calculators_static")
MARKER = "dtm-calculator"
CORE_ZIP = "labs-core.zip"


def prepare(app):
    """Pyodide unpacked and checked, the core zip made: before any page is read, so a build that
    cannot ship working calculators fails in its first seconds."""
    if app.builder.format != "html":
        return
    try:
        app.dtm_pyodide = pyodide_dist.unpack()
    except pyodide_dist.PyodideError as e:
        raise ExtensionError(str(e)) from None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, CORE_ZIP)
        core_bundle.write_zip(path)
        with open(path, "rb") as f:
            app.dtm_core = f.read()


def add_assets(app, pagename, templatename, context, doctree):
    """calculators.js and .css on the pages that have a calculator; the core zip's URL carries its
    hash, so a reader's browser never answers with a cached older zip."""
    if MARKER not in context.get("body", ""):
        return
    version = hashlib.sha256(app.dtm_core).hexdigest()[:12]
    app.add_css_file("calculators.css")
    app.add_js_file("calculators.js", loading_method="defer", **{"data-core": f"{CORE_ZIP}?v={version}"})


def copy_files(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    static = os.path.join(app.outdir, "_static")
    target = os.path.join(static, "pyodide")
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    for name in pyodide_dist.RUNTIME:
        shutil.copyfile(os.path.join(app.dtm_pyodide, name), os.path.join(target, name))
    with open(os.path.join(static, CORE_ZIP), "wb") as f:
        f.write(app.dtm_core)
    for name in os.listdir(ASSETS):
        shutil.copyfile(os.path.join(ASSETS, name), os.path.join(static, name))


def setup(app):
    app.connect("builder-inited", prepare)
    # before offline_site's drop_thebe (priority 500), which gives the page a new list of scripts
    app.connect("html-page-context", add_assets, priority=400)
    app.connect("build-finished", copy_files)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

