"""tools/check_site.py fails on each defect a reader would see, naming the page, and passes a clean page.

A tiny site is written here: one page per defect, and clean pages whose math MathJax (served
locally, from sphinx-mathjax-offline) must typeset before the raw-TeX check looks at them.
"""
import base64
import importlib.util
import os
import subprocess
import sys

import pytest

# The browser check belongs to the book's toolchain (`make test` installs it); a GPU box that only
# runs the labs and notebooks (`make box-test`) has no playwright.
pytest.importorskip("playwright", reason="playwright is not installed: no browser check on this machine")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "tools", "check_site.py")
PNG = base64.b64decode(  # 1x1 pixel
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")

CLEAN = {
    "clean.html": """<script defer src="_static/mathjax/tex-chtml.js"></script>
        <h1 id="top">Clean</h1>
        <p>Inline <span class="math">\\(2(N-1)/N \\cdot M\\)</span> and display:</p>
        <div class="math">\\[\\begin{aligned} a &= \\frac{b}{c} \\\\ d &= e \\end{aligned}\\]</div>
        <table><tr><th>a</th><th>b</th></tr><tr><td>1</td><td>2</td></tr></table>
        <img src="dot.png" alt="dot"> <a href="other.html#part">other</a> <a href="#top">top</a>
        <div class="cell_input"><pre>print("| a |\\n|---|")  # prose code may show anything</pre></div>
        <div class="cell_output"><pre>a short output line</pre></div>""",
    "other.html": '<h1>Other</h1><section id="part"><p>The part.</p></section>',
    # a table wider than the column scrolls inside it: listed as a note, not a failure
    "wide.html": '<div class="cell_output"><div style="width: 200px; overflow-x: auto"><table><tr>'
                 + "<td>wide_column_of_text</td>" * 20 + "</tr></table></div></div>",
}

# page -> (body, what the report must say about that page)
BROKEN = {
    "pipe.html": ("<p>| a | b |\n|---|---|\n| 1 | 2 |</p>", "raw pipe table"),
    "dash.html": ("<p>| a | b |\n|\u2014|\u2014|\n| 1 | 2 |</p>", "raw pipe table"),  # after smartquotes
    "tex.html": ("<p>$$x^2$$</p>", "raw TeX"),
    "begin.html": ("<p>\\begin{aligned} a &amp;= b \\end{aligned}</p>", "raw TeX"),
    "nomath.html": ('<span class="math">\\(x^2\\)</span>', "formulas not typeset: 1"),  # no MathJax on it
    "glue.html": ("<p>{glue:text}`n_params`</p>", "unresolved glue"),
    "image.html": ('<img src="missing.png" alt="x">', "broken image"),
    "link.html": ('<a href="nowhere.html">a</a>', "broken link: nowhere.html (no such file)"),
    "anchor.html": ('<a href="other.html#no-such-part">a</a>', "broken link: other.html#no-such-part (no such anchor)"),
    "console.html": ('<script>console.error("boom")</script>', "console error: boom"),
    "exception.html": ("<script>notDefinedAnywhere()</script>", "uncaught exception"),
    "external.html": ('<img src="http://example.com/x.png" alt="x">', "request to another host (blocked): http://example.com/x.png"),
    "overflow.html": ('<div class="cell_output" style="width: 300px"><pre style="white-space: pre; overflow: auto">'
                      + "long " * 100 + "</pre></div>", "output cut off at the right edge"),
    "nbval.html": ('<div class="cell_input"><pre># NBVAL_IGNORE_OUTPUT\nx = 1</pre></div>', "nbval marker in a code cell"),
}


def write_site(folder, pages):
    os.makedirs(os.path.join(folder, "_static"), exist_ok=True)
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    os.symlink(os.path.join(os.path.dirname(spec.origin), "static", "mathjax"),
               os.path.join(folder, "_static", "mathjax"))
    with open(os.path.join(folder, "dot.png"), "wb") as f:
        f.write(PNG)
    for name, body in pages.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{name}</title></head>'
                    f"<body>{body}</body></html>")


def check(folder, *args):
    return subprocess.run([sys.executable, CHECK, str(folder), *args],
                          capture_output=True, text=True, timeout=120)


def test_each_defect_fails_and_is_named(tmp_path):
    write_site(tmp_path, {**CLEAN, **{page: body for page, (body, _) in BROKEN.items()}})
    r = check(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for page, (_, defect) in BROKEN.items():
        assert any(line.startswith(f"{page}: ") and defect in line for line in lines), (page, defect, r.stdout)
    assert not any(line.startswith(("clean.html", "other.html")) for line in lines), r.stdout
    assert not any(line.startswith("wide.html") and "note:" not in line for line in lines), r.stdout


def test_clean_site_passes_with_math_typeset(tmp_path):
    write_site(tmp_path, CLEAN)
    r = check(tmp_path, "--screenshots", str(tmp_path / "shots"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 pages" in r.stdout and "no defects" in r.stdout
    assert "wide.html: note: an output table scrolls sideways: wide_column_of_text" in r.stdout
    assert sorted(os.listdir(tmp_path / "shots")) == ["clean.png", "other.png", "wide.png"]


def test_missing_browser_fails_with_the_install_command(tmp_path):
    write_site(tmp_path, CLEAN)
    r = check(tmp_path, "--chromium", str(tmp_path / "no-such-chromium"))
    assert r.returncode != 0
    assert "apt-get install chromium" in r.stderr

