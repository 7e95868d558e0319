"""The book's calculators: their fields, their answers, and the one sentence bad input gets.

A form is a list of `fields.Field`s and a function from their values to an answer. The site renders
the fields in the reader's browser and runs `answer` there with Pyodide (`_static/calculators.js`);
JupyterLab builds the same fields as widgets (`labs.measure.widgets`); the browser check compares
the browser's answer with CPython's. Values arrive as strings, as a form sends them; bad input
becomes {"ok": False, "error": one sentence}, the sentence the command line prints.

    answer("bubble", {"schedule": "1f1b", "p": "8", "m": "32", "v": "1"})
"""
from labs.formulas import fields, form_bubble, form_collective, form_memory, form_planner
from labs.formulas.fields import text, to_html   # noqa: F401 (the renderers, with the forms)

FORMS = {
    "memory": ("Will it fit? Memory per GPU (chapter 1)", form_memory.FIELDS, form_memory.answer),
    "collective": ("One collective's time (chapters 2 and 10)", form_collective.FIELDS,
                   form_collective.answer),
    "bubble": ("The pipeline bubble (chapter 5)", form_bubble.FIELDS, form_bubble.answer),
    "planner": ("Which layout? The planner (chapter 14)", form_planner.FIELDS, form_planner.answer),
}


def spec(form):
    """The fields of ``form`` as plain dicts (JSON), for a renderer."""
    return {"title": FORMS[form][0], "fields": [f.spec() for f in FORMS[form][1]]}


def defaults(form):
    return {f.name: f.default for f in FORMS[form][1]}


def answer(form, values=None):
    """{"ok": True, "summary", "table": {"head", "rows"}, optionally "svg"} or {"ok": False, "error"};
    fields left out take their defaults."""
    if form not in FORMS:
        return {"ok": False, "error": f"unknown calculator {form!r}; choose one of {', '.join(FORMS)}."}
    try:
        return FORMS[form][2]({**defaults(form), **(values or {})})
    except ValueError as exc:
        return {"ok": False, "error": str(exc)}


__all__ = ["FORMS", "answer", "defaults", "fields", "spec", "text", "to_html"]
