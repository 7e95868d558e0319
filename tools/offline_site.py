"""Sphinx extension (loaded by _config.yml): nothing on a built page loads from another host.

sphinx-thebe, which Jupyter Book always loads, declares `const THEBE_JS_URL` (an unpkg URL)
in a script on every page, twice, which is a console error; the site has no thebe launch
button, so its scripts are dropped. MathJax comes from sphinx-mathjax-offline (_config.yml),
widget scripts are off (`nb_ipywidgets_js: {}`). `tools/check_site.py` verifies the result in
a browser with every request to another host blocked.
"""


def _is_thebe(asset):
    filename = getattr(asset, "filename", None) or ""
    body = (getattr(asset, "attributes", None) or {}).get("body", "")
    return "thebe" in filename or "THEBE_JS_URL" in body


def drop_thebe(app, pagename, templatename, context, doctree):
    for key in ("script_files", "css_files"):
        if key in context:
            context[key] = [a for a in context[key] if not _is_thebe(a)]


def setup(app):
    app.connect("html-page-context", drop_thebe)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
