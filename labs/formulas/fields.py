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


def stacked_bars_svg(rows, caption, limit=None, limit_label=""):
    """Horizontal bars, one per row [(label, [(part, value)])], each stacked from its parts in order,
    on one scale; a dashed line at ``limit`` (``limit_label`` under it); a legend of the parts; the
    ``caption`` says what the length is. The chart repeats the table's figures as a picture only."""
    width, left, bar, gap = 600, 44, 26, 8
    scale = max([sum(v for _, v in parts) for _, parts in rows] + [limit or 0]) * 1.05 or 1.0
    inner = width - left - 10
    out, y = [], 10
    for label, parts in rows:
        x = left
        out.append(f'<text x="{left - 6}" y="{y + bar * 0.7:.1f}" font-size="13" text-anchor="end">'
                   f"{html.escape(label)}</text>")
        for i, (_, value) in enumerate(parts):
            w = inner * max(value, 0) / scale
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" '
                       f'fill="{COLOURS[i % len(COLOURS)]}"/>')
            x += w
        y += bar + gap
    if limit is not None:
        lx = left + inner * limit / scale
        out.append(f'<line x1="{lx:.1f}" y1="4" x2="{lx:.1f}" y2="{y - gap + 6}" stroke="#222" '
                   f'stroke-dasharray="4 3" stroke-width="2"/><text x="{min(lx + 4, width - 160):.1f}" '
                   f'y="{y + 10}" font-size="13">{html.escape(limit_label)}</text>')
        y += 16
    out.append(f'<text x="{left}" y="{y + 10}" font-size="13" fill="#555">{html.escape(caption)}</text>')
    y += 22
    names = [part for part, _ in rows[0][1]] if rows else []
    for i, name in enumerate(names):
        lx, ly = left + 150 * (i % 4), y + 20 * (i // 4)
        out.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{COLOURS[i % len(COLOURS)]}"/>'
                   f'<text x="{lx + 16}" y="{ly + 11}" font-size="13">{html.escape(name)}</text>')
    height = y + 20 * ((len(names) + 3) // 4) + 4
    return (f'<svg viewBox="0 0 {width} {height}" width="100%" role="img" '
            f'xmlns="http://www.w3.org/2000/svg">{"".join(out)}</svg>')
