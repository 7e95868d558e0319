"""The notebooks open cleanly in JupyterLab, the book's second way in (`make lab`).

Opening a notebook must not mark it modified: JupyterLab writes the running kernel's spec into
``metadata.kernelspec`` and its ``language_info``, and saves through nbformat, so a committed
notebook must already hold exactly those and be byte for byte what nbformat writes. And its
Markdown must read the same in JupyterLab as on the site: a MyST role such as {doc} shows raw in
JupyterLab, and so does a chapter's .md (as MyST source, every number an unresolved glue role), so
the first cell links to the chapter's page on the built site, which `make lab` serves beside
JupyterLab and the site resolves to itself. The cases at the end show each check fails on what
the notebooks held before.
"""
import glob
import io
import json
import os
import re
import sys

import nbformat
import pytest
from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelspec import get_kernel_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
ROLE = re.compile(r"\{[a-z][\w:-]*\}`")           # {doc}`...`, {ref}`...`, {numref}`...`, {glue:text}`...`
KERNEL = get_kernel_dict()


def kernelspec():
    """What JupyterLab writes into a notebook when the default Python kernel starts."""
    return {"display_name": KERNEL["display_name"], "language": KERNEL["language"], "name": "python3"}


def problems(text):
    """Why opening this notebook in JupyterLab would change it or show a raw role; [] if it would not."""
    out = []
    nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
    nbformat.validate(nb)
    if nb.metadata.get("kernelspec") != kernelspec():
        out.append(f"kernelspec {nb.metadata.get('kernelspec')} is not the kernel's {kernelspec()}")
    info = dict(nb.metadata.get("language_info", {}))
    version = info.pop("version", "")
    wanted = {k: v for k, v in IPythonKernel.language_info.items() if k != "version"}
    if info != wanted or not re.fullmatch(r"3\.\d+\.\d+", version):
        out.append(f"language_info {nb.metadata.get('language_info')} is not what ipykernel reports")
    saved = io.StringIO()
    nbformat.write(nb, saved, version=nbformat.NO_CONVERT)   # what the server writes on save
    if saved.getvalue() != text:
        out.append("saving it through nbformat would change its bytes")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and ROLE.search(cell.source):
            out.append(f"cell {i} shows a raw MyST role in JupyterLab: {ROLE.search(cell.source).group(0)}")
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_opens_unmodified_and_without_raw_roles(path):
    with open(path, encoding="utf-8") as f:
        assert problems(f.read()) == []


# A notebook's link to its chapter: the built site's page, which `make lab` serves beside JupyterLab
# at /static/ (so JupyterLab opens the rendered chapter, not its MyST source) and which
# tools/offline_site.py makes relative on the site itself.
LINK = re.compile(r'<a href="/static/book/((\d\d)-[\w-]+)\.html">[^<]+</a>')


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_the_first_cell_links_to_its_rendered_chapter(path):
    with open(path, encoding="utf-8") as f:
        first = "".join(json.load(f)["cells"][0]["source"])
    link = LINK.search(first)
    assert link and link.group(2) == os.path.basename(path)[:2], first[:300]
    assert os.path.exists(os.path.join(ROOT, "book", link.group(1) + ".md"))
    assert "../book/" not in first               # a link to the .md opens raw MyST in JupyterLab
    assert "run `make book` if it is not built yet" in first


def test_jupyterlab_and_the_site_resolve_the_chapter_link():
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        makefile = f.read()
    assert "--ServerApp.extra_static_paths=\"['$(CURDIR)/_build/html']\"" in makefile
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import offline_site
    finally:
        sys.path.pop(0)
    for page, href in [("notebooks/03_zero_fsdp", "../book/03-zero-fsdp.html"),
                       ("index", "book/03-zero-fsdp.html")]:
        context = {"body": '<p><a href="/static/book/03-zero-fsdp.html">3. ZeRO and FSDP</a></p>'}
        offline_site.lab_links(None, page, "page.html", context, None)
        assert context["body"] == f'<p><a href="{href}">3. ZeRO and FSDP</a></p>'


def _variant(path, change):
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    change(nb)
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def _old_kernelspec(nb):
    nb["metadata"]["kernelspec"]["display_name"] = "Python 3"        # what the notebooks held before


def _raw_role(nb):
    cell = nb["cells"][0]
    cell["source"] = LINK.sub(r"{doc}`../book/\1`", "".join(cell["source"]))


def _no_language_info(nb):
    del nb["metadata"]["language_info"]["codemirror_mode"]


@pytest.mark.parametrize("change", [_old_kernelspec, _raw_role, _no_language_info],
                         ids=lambda f: f.__name__[1:])
def test_the_check_fails_on_what_jupyterlab_would_change(change):
    assert problems(_variant(NOTEBOOKS[0], change)) != []
    with open(NOTEBOOKS[0], encoding="utf-8") as f:
        text = f.read()
    assert problems(text.replace('\n}\n', '\n}')) == ["saving it through nbformat would change its bytes"]
