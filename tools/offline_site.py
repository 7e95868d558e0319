"""Sphinx extension (loaded by _config.yml): the site's pages load nothing from another host.

sphinx-thebe, which Jupyter Book always loads, declares `const THEBE_JS_URL` (an unpkg URL)
in a script on every page, twice, which is a console error; the site has no thebe launch
button, so its scripts are dropped. MathJax comes from sphinx-mathjax-offline (_config.yml),
widget scripts are off (`nb_ipywidgets_js: {}`). `tools/check_site.py` verifies the result in
a browser with every request to another host blocked.

A notebook links to its chapter as `/static/book/NN-topic.html`, where `make lab` serves the built
site beside JupyterLab (`--ServerApp.extra_static_paths`), so the link opens the rendered chapter
there; on the site the same link is rewritten to the page itself (`lab_links`).

It also corrects one theme default: pydata-sphinx-theme 0.17 adds a search field to a header
bar above the book theme's own sidebar search unless `navbar_persistent` is set, which
Jupyter Book does not let _config.yml set without replacing all theme options.
"""


def _is_thebe(asset):
    filename = getattr(asset, "filename", None) or ""
    body = (getattr(asset, "attributes", None) or {}).get("body", "")
    return "thebe" in filename or "THEBE_JS_URL" in body


def drop_thebe(app, pagename, templatename, context, doctree):
    for key in ("script_files", "css_files"):
        if key in context:
            context[key] = [a for a in context[key] if not _is_thebe(a)]


LAB_SITE = 'href="/static/'   # where `make lab` serves _build/html (Makefile, target lab)


def lab_links(app, pagename, templatename, context, doctree):
    """The links written for JupyterLab (``LAB_SITE``) made relative to this page of the site."""
    if "body" in context:
        context["body"] = context["body"].replace(LAB_SITE, 'href="' + "../" * pagename.count("/"))


def no_header_search(app, config):
    config.html_theme_options.setdefault("navbar_persistent", [])


def setup(app):
    app.connect("config-inited", no_header_search)
    app.connect("html-page-context", drop_thebe)
    app.connect("html-page-context", lab_links)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
