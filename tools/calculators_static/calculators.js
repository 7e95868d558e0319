/* The book's calculators, answered by Python in the reader's browser (tools/calculators.py).
 *
 * Each <div class="dtm-calculator" data-form="NAME"> becomes a form built from
 * labs.formulas.forms.spec(NAME); every change answers again (typing: once the reader pauses)
 * with forms.answer and shows forms.to_html(result): the same Python the labs and the tests run, under Pyodide, loaded from
 * this site's own _static/pyodide/ (never a CDN) with the labs' core from _static/labs-core.zip.
 * After each answer the output carries data-values (the JSON answered), data-ok and data-answers
 * (how many answers it has shown), and the
 * calculator data-state="ready" and data-first-answer-ms, for tools/check_calculators.py.
 */
(function () {
  "use strict";
  const script = document.currentScript;
  const STATIC = new URL(".", script.src);                       // this site's _static/
  const PYODIDE = new URL("pyodide/", STATIC);
  const CORE = new URL(script.dataset.core || "labs-core.zip", STATIC);
  const CORE_DIR = "/home/pyodide/dtm-core";
  // Typing answers once the reader pauses this long, not at every key: one answer of the planner
  // takes a second or more under Pyodide, and the page cannot take the next key until it is done.
  const TYPING_PAUSE_MS = 300;
  const LOADING = "Loading the calculator: Python runs in your browser\u2026";
  const SERVE = "This calculator runs Python in your browser, which a page opened from disk cannot " +
    "load: serve the site's folder over HTTP (for example python3 -m http.server -d _build/html) " +
    "and open it from there.";
  const HELPERS = `
import json, sys
sys.path.insert(0, ${JSON.stringify(CORE_DIR)})
from labs.formulas import forms as _dtm_forms

def _dtm_spec(name):
    return json.dumps(_dtm_forms.spec(name) if name in _dtm_forms.FORMS else None)

def _dtm_answer(name, values):
    try:
        result = _dtm_forms.answer(name, json.loads(values))
    except Exception as exc:  # a fault of the calculator, not of the input: said, not thrown
        result = {"ok": False, "error": f"The calculator failed ({type(exc).__name__}: {exc})."}
    return json.dumps({"ok": bool(result["ok"]), "html": _dtm_forms.to_html(result)})
`;

  let python = null;   // the promise of {spec, answer}, started once for the whole page

  function element(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function status(box, text, kind) {
    box.replaceChildren(element("p", {class: "dtm-status" + (kind ? " dtm-" + kind : ""),
                                      role: "status"}, text));
  }

  async function start() {
    const [{loadPyodide}, core] = await Promise.all([
      import(new URL("pyodide.mjs", PYODIDE).href),
      fetch(CORE).then(r => {
        if (!r.ok) throw new Error(`${CORE.pathname} answered HTTP ${r.status}`);
        return r.arrayBuffer();
      }),
    ]);
    const py = await loadPyodide({indexURL: PYODIDE.href, fullStdLib: false});
    py.unpackArchive(core, "zip", {extractDir: CORE_DIR});
    py.runPython(HELPERS);
    const spec = py.globals.get("_dtm_spec"), answer = py.globals.get("_dtm_answer");
    return {
      spec: name => JSON.parse(spec(name)),
      answer: (name, values) => JSON.parse(answer(name, JSON.stringify(values))),
    };
  }

  function field(f, id) {
    const wrap = element("div", {class: "dtm-field"});
    wrap.append(element("label", {for: id}, f.label));
    let input;
    if (f.kind === "choice") {
      input = element("select", {id: id, name: f.name});
      for (const c of f.choices) input.append(element("option", {value: c}, c));
    } else {  // text, not type=number: the forms read "1,024" and say what is wrong with "x"
      input = element("input", {id: id, name: f.name, type: "text", autocomplete: "off",
                                spellcheck: "false", inputmode: f.kind === "int" ? "numeric" : "decimal"});
    }
    input.value = f.default;
    wrap.append(input);
    if (f.help) {
      wrap.append(element("small", {class: "dtm-help", id: id + "-help"}, f.help));
      input.setAttribute("aria-describedby", id + "-help");
    }
    return wrap;
  }

  async function mount(box, index) {
    const name = box.dataset.form || "";
    const py = await python;
    const spec = py.spec(name);
    const output = element("div", {class: "dtm-output", "aria-live": "polite"});
    const answered = () => {
      if (box.dataset.state === "ready") return;
      box.dataset.firstAnswerMs = String(Math.round(performance.now()));
      box.dataset.state = "ready";
    };
    if (spec === null) {  // an unknown form: forms.answer says so, in its sentence
      box.replaceChildren(output);
      output.innerHTML = py.answer(name, {}).html;
      answered();
      return;
    }
    const form = element("form", {class: "dtm-form", novalidate: "", "aria-label": spec.title});
    const fields = element("div", {class: "dtm-fields"});
    spec.fields.forEach(f => fields.append(field(f, `dtm-${index}-${f.name}`)));
    const button = element("button", {type: "submit", class: "dtm-answer"}, "Answer");
    form.append(fields, button);
    box.replaceChildren(element("p", {class: "dtm-title"}, spec.title), form, output);

    let answeredFor = null, typing = null;
    const respond = () => {
      clearTimeout(typing);
      const values = {};
      for (const f of spec.fields) values[f.name] = form.elements[f.name].value;
      const key = JSON.stringify(values);
      if (key === answeredFor) return;  // a field's change event after its input events: answered
      answeredFor = key;
      let result;
      try {
        result = py.answer(name, values);
      } catch (err) {  // Pyodide itself failed: a sentence, never an exception on the page
        result = {ok: false, html: ""};
        output.replaceChildren(element("p", {class: "dtm-error"}, `The calculator failed: ${err.message}`));
      }
      if (result.html) output.innerHTML = result.html;
      output.dataset.values = JSON.stringify(values);
      output.dataset.answers = String(Number(output.dataset.answers || 0) + 1);
      output.dataset.ok = String(result.ok);
      answered();
    };
    form.addEventListener("input", () => {
      clearTimeout(typing);
      typing = setTimeout(respond, TYPING_PAUSE_MS);
    });
    form.addEventListener("change", respond);  // a choice made, a field left: at once
    form.addEventListener("submit", event => { event.preventDefault(); respond(); });
    respond();
  }

  function boot() {
    const boxes = Array.from(document.querySelectorAll(".dtm-calculator"));
    if (!boxes.length) return;
    if (location.protocol === "file:") {
      boxes.forEach(box => { status(box, SERVE, "error"); box.dataset.state = "file"; });
      return;
    }
    boxes.forEach(box => status(box, LOADING));
    python = start();
    boxes.forEach((box, i) => mount(box, i).catch(err => {
      status(box, `The calculator could not start: ${err.message || err}`, "error");
      box.dataset.state = "failed";
      console.error("calculator:", err);  // a failure the browser check reports
    }));
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", boot);
  else boot();
})();
