"""Every rank function the labs and the notebooks start, found in their source.

A rank function is the first argument of ``launch.spawn`` or ``launch.launch``: in the labs'
modules (read with `ast`, the module's own imports resolving its names) and in the notebooks'
code cells (their ``import ... as`` lines resolving the aliases). `tests/test_devices.py` checks
each one runs on a GPU or says it runs on the CPU.
"""
import ast
import glob
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _aliases(tree, module):
    """{name in the source: dotted name it stands for} from the source's imports."""
    out = {}
    package = module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def _dotted(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := _dotted(node.value)):
        return f"{head}.{node.attr}"
    return None


def _calls(tree, module, aliases, where):
    """{"module.function": where} for each spawn/launch call whose first argument resolves."""
    found = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        callee = _dotted(node.func) or ""
        if not (callee.endswith(("launch.spawn", "launch.launch")) or callee in ("spawn", "launch")):
            continue
        target = _dotted(node.args[0])
        if target is None:
            continue
        head, _, rest = target.partition(".")
        if head in aliases:
            full = aliases[head] + (f".{rest}" if rest else "")
        elif not rest:
            full = f"{module}.{target}"      # a function of the same module
        else:
            continue                          # a local variable (a test's own helper, say)
        found.setdefault(full, where)
    return found


def rank_functions(root=ROOT):
    """{"labs.module.function": "file:line of one place that starts it"} for the labs and notebooks."""
    found = {}
    for path in sorted(glob.glob(os.path.join(root, "labs", "**", "*.py"), recursive=True)):
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        if module.startswith("labs.launcher"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for name, where in _calls(tree, module, _aliases(tree, module), os.path.relpath(path, root)).items():
            found.setdefault(name, where)
    for path in sorted(glob.glob(os.path.join(root, "notebooks", "*.ipynb"))):
        with open(path, encoding="utf-8") as f:
            cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
        source = "\n".join("".join(c["source"]) for c in cells)
        source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("!", "%")))
        tree = ast.parse(source)
        calls = _calls(tree, "__main__", _aliases(tree, "__main__"), os.path.relpath(path, root))
        for name, where in calls.items():
            found.setdefault(name, where)
    return {k: v for k, v in found.items() if k.startswith("labs.")}
