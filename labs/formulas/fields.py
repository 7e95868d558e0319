"""The calculators' fields and how an answer is shown: parsing a form's strings, one sentence for
bad input, the answer as text and as HTML, and a bar chart as SVG (no plotting library: the same
string draws on the site, in JupyterLab and in a test)."""
import html
from dataclasses import dataclass


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


def raw(values, field):
    return str(values.get(field.name, field.default)).strip()


def _parsed(values, field, convert, kind):
    text = raw(values, field).replace(",", "").replace("_", "")   # thousands separators allowed
    try:
        return convert(text), text
    except ValueError:
        raise ValueError(f"{field.label} must be {kind}, got {text!r}.") from None


def whole(values, field, least=1):
    """``field``'s value as an int of at least ``least``."""
    value, _ = _parsed(values, field, int, "a whole number")
    if value < least:
        raise ValueError(f"{field.label} must be at least {least}, got {value}.")
    return value


def number(values, field, above=0.0):
    """``field``'s value as a float greater than ``above``."""
    value, text = _parsed(values, field, float, "a number")
    if not value > above:         # also refuses nan
        raise ValueError(f"{field.label} must be more than {above:g}, got {text}.")
    return value


def choice(values, field):
    text = raw(values, field)
    if text not in field.choices:
        raise ValueError(f"{field.label} must be one of {', '.join(field.choices)}, got {text!r}.")
    return text


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
    """The answer as HTML whose visible text is `text`'s; an SVG chart, if any, follows it."""
    e = html.escape
    if not result["ok"]:
        return f'<p class="dtm-error">{e(result["error"])}</p>'
    out = [f'<p class="dtm-summary">{e(result["summary"])}</p>']
    t = result.get("table")
    if t:
        head = "".join(f"<th>{e(h)}</th>" for h in t["head"])
        rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in t["rows"])
        out.append(f'<div class="dtm-table-wrap"><table class="dtm-table"><thead><tr>{head}</tr></thead>'
                   f"<tbody>{rows}</tbody></table></div>")
    if result.get("svg"):
        out.append(f'<div class="dtm-chart" aria-hidden="true">{result["svg"]}</div>')
    return "".join(out)


COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")


def stacked_bar_svg(parts, limit, limit_label, unit="GiB"):
    """One horizontal bar of ``parts`` [(name, value)] stacked, against a dashed line at ``limit``,
    with a legend; values in ``unit``. The chart repeats the table's figures as a picture only."""
    width, left, top = 600, 10, 10
    scale_max = max(sum(v for _, v in parts), limit) * 1.05 or 1.0
    x = left
    bars, legend = [], []
    for i, (name, value) in enumerate(parts):
        w = (width - 2 * left) * value / scale_max
        colour = COLOURS[i % len(COLOURS)]
        bars.append(f'<rect x="{x:.1f}" y="{top}" width="{max(w, 0):.1f}" height="36" fill="{colour}"/>')
        legend.append(f'<rect x="{left + 150 * (i % 4)}" y="{70 + 20 * (i // 4)}" width="12" height="12" '
                      f'fill="{colour}"/><text x="{left + 16 + 150 * (i % 4)}" y="{81 + 20 * (i // 4)}" '
                      f'font-size="13">{html.escape(name)}</text>')
        x += w
    lx = left + (width - 2 * left) * limit / scale_max
    line = (f'<line x1="{lx:.1f}" y1="{top - 6}" x2="{lx:.1f}" y2="{top + 44}" stroke="#222" '
            f'stroke-dasharray="4 3" stroke-width="2"/>'
            f'<text x="{min(lx + 4, width - 150):.1f}" y="{top + 58}" font-size="13">'
            f'{html.escape(limit_label)}</text>')
    rows = (len(parts) + 3) // 4
    return (f'<svg viewBox="0 0 {width} {86 + 20 * rows}" width="100%" role="img" '
            f'xmlns="http://www.w3.org/2000/svg">{"".join(bars)}{line}{"".join(legend)}</svg>')
