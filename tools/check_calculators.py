"""The site's calculators in Chromium, against CPython: part of tools/check_site.py.

On every page with a `<div class="dtm-calculator" data-form=NAME>`, at 1280 and at 390 px, each in
a fresh browser context (an empty cache: what a first visit costs):

- the cold time, from navigation to the first answer (the page's `performance.now()` when the
  calculator first answered): reported, a defect above COLD_LIMIT_S;
- for each calculator, every case of `cases(NAME)` (each field set to a value other than its default
  that CPython accepts, then any cases of TABLE; at the second width the first case alone, since an
  answer does not depend on the width): the fields are set as a reader would set them, and
  the answer's visible text (its chart, if any, left out) must carry the same sequence of numbers
  as CPython's `forms.text(forms.answer(NAME, values))`, its summary sentence word for word;
- one bad input (`bad(NAME)`: "0", else "x", in the first number field): the visible error must be
  CPython's error sentence exactly;
- the calculator stays inside its box, and the page does not scroll sideways once it has answered;
- console errors and uncaught exceptions while it loads and answers.

`site_bytes` is what the calculators add to the site (Pyodide's files, the core zip, the assets).
"""
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLD_GOAL_S = 10      # the first answer on a 2-core machine, reported against this
COLD_LIMIT_S = 60     # a defect above this
MARKER = 'class="dtm-calculator"'
NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")
# More cases per form, beyond the derived one (values not given keep their defaults).
TABLE = {
    "bubble": [{"schedule": "interleaved", "p": "4", "m": "12", "v": "2"},
               {"schedule": "zb-h1", "p": "16", "m": "8"}],
    "memory": [{"model": "custom", "layers": "48", "hidden": "7168", "heads": "56", "kv_heads": "8",
                "ffn": "20480", "vocab": "64000", "dp": "16", "tp": "1", "zero": "2", "seq": "8192"},
               {"model": "405B", "dp": "64", "tp": "8", "pp": "7", "zero": "1", "recompute": "full"}],
    "planner": [{"model": "405B", "gpus": "1024", "batch_tokens": "16777216", "seq": "8192"},
                {"model": "custom", "layers": "32", "hidden": "4096", "heads": "32", "kv_heads": "8",
                 "ffn": "14336", "vocab": "32000", "experts": "8", "top_k": "2", "expert_ffn": "14336",
                 "gpus": "16", "batch_tokens": "1048576"},
                {"gpus": "8"}],
    "collective": [{"op": "all_to_all", "size_mib": "8", "ranks": "16"},
                   {"cluster": "2 x RTX 3090 (PCIe)", "ranks": "2", "size_mib": "512"}],
}
STATE = """boxes => boxes.length > 0 && boxes.every(b => b.dataset.state)"""
ANSWERED = """(out, expected) => {
  const got = JSON.parse(out.dataset.values || '{}');
  return Object.entries(expected).every(([k, v]) => got[k] === v);
}"""
# The answer as the reader sees it, the chart (an SVG with its own axis numbers) left out.
SHOWN = """out => Array.from(out.children).filter(c => !c.classList.contains('dtm-chart'))
                         .map(c => c.innerText).join('\\n')"""
LAYOUT = """box => ({box: box.scrollWidth - box.clientWidth,
                    page: document.documentElement.scrollWidth - document.documentElement.clientWidth})"""


def forms():
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from labs.formulas import forms as module
    return module


def numbers(text):
    return [n.replace(",", "") for n in NUMBER.findall(text)]


def defaults(name):
    return {f["name"]: f["default"] for f in forms().spec(name)["fields"]}


def other_value(field):
    """A value of ``field`` other than its default: the next choice, the default doubled."""
    if field["kind"] == "choice":
        rest = [c for c in field["choices"] if c != field["default"]]
        return rest[0] if rest else field["default"]
    if field["kind"] == "int":
        return str(2 * int(field["default"]) if int(field["default"]) else 3)
    return repr(1.5 * float(field["default"]) if float(field["default"]) else 0.5)


def cases(name):
    """Value sets CPython accepts: every field moved off its default where that stays valid (one at
    a time, in order, kept when CPython still answers), then TABLE's cases over the defaults."""
    f = forms()
    values = defaults(name)
    for field in f.spec(name)["fields"]:
        trial = dict(values, **{field["name"]: other_value(field)})
        if f.answer(name, trial)["ok"]:
            values = trial
    return [values] + [dict(defaults(name), **case) for case in TABLE.get(name, [])]


def bad(name):
    """Values CPython refuses: "0" or else "x" in the first number field (None if there is none)."""
    f = forms()
    for field in f.spec(name)["fields"]:
        if field["kind"] in ("int", "float"):
            for raw in ("0", "x"):
                values = dict(defaults(name), **{field["name"]: raw})
                if not f.answer(name, values)["ok"]:
                    return values
    return None


def calculator_pages(site_dir, pages):
    found = []
    for page in pages:
        with open(os.path.join(site_dir, page), encoding="utf-8", errors="replace") as fh:
            if MARKER in fh.read():
                found.append(page)
    return found


def site_bytes(site_dir):
    """{part: bytes} the calculators add: _static/pyodide, the core zip, calculators.js and .css."""
    static = os.path.join(site_dir, "_static")
    pyodide = os.path.join(static, "pyodide")
    parts = {"_static/pyodide": sum(os.path.getsize(os.path.join(pyodide, n)) for n in os.listdir(pyodide))
             if os.path.isdir(pyodide) else 0}
    for name in ("labs-core.zip", "calculators.js", "calculators.css"):
        path = os.path.join(static, name)
        parts[f"_static/{name}"] = os.path.getsize(path) if os.path.isfile(path) else 0
    return parts


async def set_fields(box, spec, values):
    for field in spec["fields"]:
        control = box.locator(f'[name="{field["name"]}"]')
        if field["kind"] == "choice":
            await control.select_option(values[field["name"]])
        else:
            await control.fill(values[field["name"]])
    output = box.locator(".dtm-output")
    handle = await output.element_handle()
    await box.page.wait_for_function(f"([out, expected]) => ({ANSWERED})(out, expected)",
                                     arg=[handle, values], timeout=10000)
    return output


async def check_calculator(box, name, where, add, every_case=True):
    """Each case (or, not ``every_case``, the first) and the bad input of one calculator, compared with
    CPython; defects through add."""
    f = forms()
    if name not in f.FORMS:
        add(f"{where}: data-form={name!r} names no form of labs.formulas.forms")
        return
    spec = f.spec(name)
    for values in cases(name) if every_case else cases(name)[:1]:
        output = await set_fields(box, spec, values)
        result = f.answer(name, values)
        shown = await output.evaluate(SHOWN)
        said = f.text(result)
        if numbers(shown) != numbers(said):
            add(f"{where}: {values} answered with the numbers {numbers(shown)}, CPython {numbers(said)}")
        if not result["ok"]:    # a case CPython refuses: the same sentence must show
            shown = " ".join(" ".join(await output.locator(".dtm-error").all_inner_texts()).split())
            if shown != " ".join(result["error"].split()):
                add(f"{where}: {values} showed {shown!r}, CPython says {result['error']!r}")
            continue
        summary = " ".join((await output.locator(".dtm-summary").all_inner_texts() or [""])[0].split())
        if summary != " ".join(result["summary"].split()):
            add(f"{where}: {values} gave the summary {summary!r}, CPython {result['summary']!r}")
    values = bad(name)
    if values is not None:
        output = await set_fields(box, spec, values)
        expected = f.answer(name, values)["error"]
        shown = " ".join(" ".join(await output.locator(".dtm-error").all_inner_texts()).split())
        if shown != " ".join(expected.split()):
            add(f"{where}: bad input {values} showed {shown!r}, CPython says {expected!r}")


async def check_page(browser, site, page, viewport, route, shots, timeout_s, every_case=True):
    """One page at one width in a fresh context; returns the cold time in seconds (or None)."""
    context = await browser.new_context(viewport=viewport)
    await context.route("**/*", route)
    tab = await context.new_page()
    width = viewport["width"]

    def add(defect):
        site.add(page, f"calculator at {width} px: {defect}")

    tab.on("console", lambda msg: msg.type == "error" and add(f"console error: {msg.text[:200]}"))
    tab.on("pageerror", lambda err: add(f"uncaught exception: {str(err)[:200]}"))
    cold = None
    try:
        await tab.goto(site.base + page, wait_until="commit", timeout=timeout_s * 1000)
        boxes = tab.locator(".dtm-calculator")
        try:
            await tab.wait_for_function(f"() => ({STATE})(Array.from(document.querySelectorAll("
                                        "'.dtm-calculator')))", timeout=COLD_LIMIT_S * 1000)
        except Exception:
            add(f"no answer within {COLD_LIMIT_S} s: {' | '.join(await boxes.all_inner_texts())[:200]}")
            return None
        for i in range(await boxes.count()):
            box = boxes.nth(i)
            state, name = await box.get_attribute("data-state"), await box.get_attribute("data-form")
            if state != "ready":
                add(f"{name} did not start ({state}): {(await box.inner_text())[:200]}")
                continue
            ms = int(await box.get_attribute("data-first-answer-ms") or 0)
            cold = max(cold or 0, ms / 1000)
            await check_calculator(box, name, name, add, every_case)
            layout = await box.evaluate(LAYOUT)
            if layout["box"] > 1:
                add(f"{name}: its content is {layout['box']} px wider than its box")
            if layout["page"] > 1:
                add(f"{name}: the page scrolls sideways by {layout['page']} px once it has answered")
            if shots:
                await box.screenshot(path=os.path.join(
                    shots, page.replace("/", "__").removesuffix(".html") + f"@calculator{i}-{width}.png"))
        if cold is not None and cold > COLD_LIMIT_S:
            add(f"the first answer took {cold:.1f} s (limit {COLD_LIMIT_S} s)")
    except Exception as e:  # a control missing, an answer that never came: a defect, named
        add(f"check failed: {str(e).splitlines()[0][:200]}")
    finally:
        await context.close()
    return cold


async def check(browser, site, pages, route, viewports, shots, timeout_s):
    """Every calculator page at each viewport, one at a time (cold times are measured alone).
    Returns [(page, {width: seconds or None})]."""
    times = []
    for page in pages:
        row = {}
        for i, viewport in enumerate(viewports):   # the answers do not depend on the width: every case once
            row[viewport["width"]] = await check_page(browser, site, page, viewport, route, shots, timeout_s,
                                                      every_case=i == 0)
        times.append((page, row))
    return times


def report(times, site_dir):
    """The lines check_site prints: each page's cold times, then the bytes the site gains."""
    lines = []
    for page, row in times:
        cells = ", ".join(f"{'no answer' if s is None else f'{s:.1f} s'} at {w} px" for w, s in row.items())
        slow = [s for s in row.values() if s is not None and s > COLD_GOAL_S]
        lines.append(f"{page}: calculator: first answer {cells} (goal {COLD_GOAL_S} s"
                     + (", missed)" if slow else ")"))
    if times:
        parts = site_bytes(site_dir)
        total = sum(parts.values())
        lines.append(f"calculators: the site gains {total:,} bytes ({total / 2**20:.1f} MiB): "
                     + ", ".join(f"{k} {v:,}" for k, v in parts.items()))
    return lines


if __name__ == "__main__":  # the CPython side, for a look: each form's cases and its bad input
    for form in forms().FORMS:
        for v in cases(form):
            print(form, json.dumps(v), "->", forms().text(forms().answer(form, v)).splitlines()[0])
        print(form, json.dumps(bad(form)), "->", forms().answer(form, bad(form) or {}).get("error"))
