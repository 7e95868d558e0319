"""The torch-free core (issue 44): `labs.formulas` and `labs.dims` import nothing but the standard
library and each other, so the site's calculators run them in a browser (Pyodide), and every form
answers, or refuses bad input in one sentence, in a Python that has no torch and no numpy.

Each check can fail: a planted ``import torch`` (top level or inside a function), an import of a
torch-using chapter module, and a form that raises instead of answering are each caught below.
"""
import ast
import os
import subprocess
import sys
import textwrap

import pytest

from labs.formulas import forms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("labs/__init__.py", "labs/dims.py", "labs/formulas")
FORBIDDEN = ("torch", "numpy")


def core_files(root=ROOT):
    out = []
    for entry in CORE:
        path = os.path.join(root, entry)
        if os.path.isdir(path):
            out += sorted(os.path.join(d, f) for d, _, files in os.walk(path)
                          for f in files if f.endswith(".py"))
        else:
            out.append(path)
    return out


def outside_imports(source, name="labs.formulas.x"):
    """Every module ``source`` imports, at any depth, that is neither the standard library's nor the
    core's: a third-party package, or a labs module outside `CORE`."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "labs"]
        else:
            continue
        for m in mods:
            top = m.split(".")[0]
            if top == "labs":
                if not (m in ("labs", "labs.dims", "labs.formulas") or m.startswith("labs.formulas.")):
                    bad.append(m)
            elif top not in sys.stdlib_module_names:
                bad.append(m)
    return bad


def test_the_core_imports_only_the_standard_library_and_itself():
    found = {os.path.relpath(p, ROOT): outside_imports(open(p).read()) for p in core_files()}
    assert {p: m for p, m in found.items() if m} == {}


def test_what_the_site_bundles_is_the_core_and_nothing_else():
    """The browser's zip holds the closure of the forms' imports (`tools/core_bundle.py`): exactly the
    core, so no chapter module, and no torch through one, reaches the browser."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import core_bundle
    bundled = sorted(os.path.relpath(os.path.join(ROOT, f), ROOT) for f in core_bundle.core_files())
    assert bundled == sorted(os.path.relpath(p, ROOT) for p in core_files())


@pytest.mark.parametrize("planted, caught", [
    ("import torch\n", ["torch"]),
    ("def f():\n    import numpy as np\n    return np\n", ["numpy"]),
    ("from labs.memory_budget import budget\n", ["labs.memory_budget"]),
    ("from labs import model\n", ["labs.model"]),
    ("import json, math\nfrom labs.formulas import costs\nfrom labs import dims\n", []),
])
def test_a_planted_import_is_caught(planted, caught):
    assert outside_imports(planted) == caught


BLOCK = textwrap.dedent("""
    import sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {forbidden!r}:
                raise ImportError(name + " is not in the browser")
    sys.meta_path.insert(0, Refuse())
""")


def run_without_torch(code):
    script = BLOCK.format(forbidden=FORBIDDEN) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_every_form_answers_in_a_python_without_torch_or_numpy():
    r = run_without_torch("""
        import importlib, pkgutil, labs.formulas
        for m in pkgutil.walk_packages(labs.formulas.__path__, "labs.formulas."):
            importlib.import_module(m.name)
        from labs.formulas import forms
        for name in forms.FORMS:
            r = forms.answer(name)
            assert r["ok"], (name, r)
            print(name, forms.text(r).splitlines()[0][:60])
        print("torch" in sys.modules, "numpy" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("False False")


def test_the_refusal_itself_works():
    r = run_without_torch("import labs.memory_budget.budget")
    assert r.returncode != 0 and "is not in the browser" in r.stderr


@pytest.mark.parametrize("name", sorted(forms.FORMS))
def test_each_form_answers_its_defaults_and_refuses_a_bad_number_in_one_sentence(name):
    ok = forms.answer(name)
    assert ok["ok"] and ok["summary"] and ok["table"]["rows"]
    for field in (f for f in forms.FORMS[name][1] if f.kind in ("int", "float")):
        # a custom model's shapes are read only when the model is custom
        context = {"model": "custom"} if "custom model only" in field.help else {}
        for bad in ("x", "-3") + (("1.5",) if field.kind == "int" else ()):
            r = forms.answer(name, {**context, field.name: bad})
            assert not r["ok"], (name, field.name, bad, r)
            assert r["error"].count(". ") == 0 and r["error"].endswith("."), r["error"]  # one sentence


def test_an_unknown_choice_and_an_unknown_form_are_one_sentence():
    assert forms.answer("memory", {"recipe": "fp4"}) == {
        "ok": False, "error": "precision recipe must be one of mixed, mixed_fp32_grads, mixed_fp32_accum, "
                              "fp32, bf16_no_master, got 'fp4'."}
    assert forms.answer("nope")["error"].startswith("unknown calculator 'nope'")


@pytest.mark.parametrize("argv, form, values", [
    (["-m", "labs.memory_budget.budget", "--model", "70B", "--world-size", "24", "--tp", "3"],
     "memory", {"model": "70B", "dp": "8", "tp": "3"}),
    (["-m", "labs.memory_budget.budget", "--model", "405B", "--world-size", "256", "--pp", "16"],
     "memory", {"model": "405B", "dp": "16", "tp": "1", "pp": "16"}),
    (["-m", "labs.planning.planner", "--batch-tokens", "1000"],
     "planner", {"batch_tokens": "1000"}),
])
def test_the_command_line_and_the_form_refuse_in_the_same_sentence(argv, form, values):
    """Bad input that reaches the formulas is refused by them, so the command line's error is the form's."""
    said = forms.answer(form, values)
    assert not said["ok"]
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1] == "error: " + said["error"]
