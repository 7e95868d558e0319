"""The book's calculators in JupyterLab: the fields of `labs.formulas.forms` as ipywidgets, answered by
the same `forms.answer` the site runs in the reader's browser. Needs ipywidgets and a running kernel.

    from labs.measure import widgets
    widgets.form("memory")
"""
from labs.formulas import forms


def form(name):
    """A box of one widget per field and the answer below it, re-answered on every change."""
    import ipywidgets as w
    spec = forms.spec(name)
    controls = {}
    for f in spec["fields"]:
        style = {"description_width": "initial"}
        if f["kind"] == "choice":
            controls[f["name"]] = w.Dropdown(options=f["choices"], value=f["default"], description=f["label"],
                                             style=style)
        else:
            controls[f["name"]] = w.Text(value=f["default"], description=f["label"], style=style,
                                         placeholder=f["help"], continuous_update=False)
    out = w.HTML()

    def update(_=None):
        out.value = forms.to_html(forms.answer(name, {k: c.value for k, c in controls.items()}))

    for c in controls.values():
        c.observe(update, names="value")
    update()
    return w.VBox([w.HTML(f"<b>{spec['title']}</b>"), w.Box(list(controls.values()),
                  layout=w.Layout(flex_flow="row wrap")), out])
