"""The book's calculators: their fields, their answers, and the one sentence bad input gets.

A form is a list of `Field`s and a function from their values to an answer. The site renders the
fields in the reader's browser and runs `answer` there with Pyodide (`_static/calculators.js`);
JupyterLab builds the same fields as widgets; check_site compares the browser's answer with
CPython's. Values arrive as strings, as a form sends them; `answer` parses them, and bad input
becomes {"ok": False, "error": one sentence}, the sentence the command line prints.

    answer("bubble", {"schedule": "1f1b", "p": "8", "m": "32", "v": "1"})
"""
import html as _html
from dataclasses import dataclass

from labs.formulas import schedules


@dataclass(frozen=True)
class Field:
    name: str
    label: str
    kind: str               # "int", "float" or "choice"
    default: str
    choices: tuple = ()     # for "choice": the values offered
    help: str = ""

    def spec(self):
        return {"name": self.name, "label": self.label, "kind": self.kind, "default": self.default,
                "choices": list(self.choices), "help": self.help}


def _int(values, name, label):
    raw = str(values.get(name, "")).strip().replace(",", "").replace("_", "")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{label} must be a whole number, got {raw!r}.") from None


def _choice(values, field):
    raw = str(values.get(field.name, field.default)).strip()
    if raw not in field.choices:
        raise ValueError(f"{field.label} must be one of {', '.join(field.choices)}, got {raw!r}.")
    return raw


# ---- chapter 5: the pipeline bubble ----------------------------------------------------------------
BUBBLE = (Field("schedule", "schedule", "choice", "1f1b", ("gpipe", "1f1b", "interleaved", "zb-h1")),
          Field("p", "stages p", "int", "8"),
          Field("m", "micro-batches m", "int", "32"),
          Field("v", "chunks per stage v", "int", "1", help="interleaved 1F1B only"))


def bubble(values):
    name = _choice(values, BUBBLE[0])
    p, m, v = (_int(values, f.name, f.label) for f in BUBBLE[1:])
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, micro-batches and chunks must be at least 1 (got p={p}, m={m}, v={v}).")
    if v != 1 and name != "interleaved":
        raise ValueError(f"v = {v} chunks per stage applies to the interleaved schedule only; use 1 for "
                         f"{name}.")
    f = schedules.formula(name, p, m, v)
    return {"ok": True,
            "summary": f"{name} on p = {p} stages with m = {m} micro-batches"
                       + (f" and v = {v} chunks" if name == "interleaved" else "")
                       + f": the bubble is {f['over_total']:.1%} of the step ({f['over_ideal']:.1%} over the "
                         "ideal time).",
            "table": {"head": ["bubble", "share"],
                      "rows": [["over the ideal time", f"{f['over_ideal']:.1%}"],
                               ["of the whole step", f"{f['over_total']:.1%}"]]}}


FORMS = {"bubble": ("The pipeline bubble", BUBBLE, bubble)}


def spec(form):
    """The fields of ``form`` as plain dicts (JSON), for a renderer."""
    return {"title": FORMS[form][0], "fields": [f.spec() for f in FORMS[form][1]]}


def answer(form, values):
    """{"ok": True, "summary", "table": {"head", "rows"}, optionally "svg"} or {"ok": False, "error"}."""
    if form not in FORMS:
        return {"ok": False, "error": f"unknown calculator {form!r}; choose one of {', '.join(FORMS)}."}
    try:
        return FORMS[form][2](values)
    except ValueError as exc:
        return {"ok": False, "error": str(exc)}


def text(result):
    """The answer as plain text: the summary, then the table's rows; or the error sentence."""
    if not result["ok"]:
        return result["error"]
    lines = [result["summary"]]
    t = result.get("table")
    if t:
        lines += ["  ".join(t["head"])] + ["  ".join(row) for row in t["rows"]]
    return "\n".join(lines)


def to_html(result):
    """The answer as HTML whose visible text is `text`'s (an SVG chart, if any, after it)."""
    e = _html.escape
    if not result["ok"]:
        return f'<p class="dtm-error">{e(result["error"])}</p>'
    out = [f'<p class="dtm-summary">{e(result["summary"])}</p>']
    t = result.get("table")
    if t:
        out.append("<table class=\"dtm-table\"><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in t["head"])
                   + "</tr></thead><tbody>"
                   + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in t["rows"])
                   + "</tbody></table>")
    if result.get("svg"):
        out.append(f'<div class="dtm-chart">{result["svg"]}</div>')
    return "".join(out)
