"""The Python the site's calculators run in the reader's browser: which files, and the zip of them.

The calculators (`labs.formulas.forms`) run under Pyodide from `_static/labs-core.zip`, unpacked
next to the standard library. The zip holds the seed files (`labs/__init__.py`, `labs/dims.py`,
everything under `labs/formulas/`) and every module of `labs` they import, followed to closure:
each `import labs.x` / `from labs.x import y` / relative import anywhere in a file (inside
functions too, where Python runs it only when called) adds that module's file and its packages'
`__init__.py`, so a module the browser would miss cannot be left out. These files must keep to
the standard library (no torch, no numpy: Pyodide's own Python has neither).

    python tools/core_bundle.py            # the files, one a line
    python tools/core_bundle.py out.zip    # and the zip
"""
import ast
import os
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "labs"
SEEDS = ("labs/__init__.py", "labs/dims.py", "labs/formulas/")   # a folder: every .py under it
ZIP_DATE = (2020, 1, 1, 0, 0, 0)   # one fixed date: the same sources give the same bytes


def _module_file(root, module):
    """The file of dotted ``module`` under ``root`` (a module or a package's __init__), or None."""
    base = os.path.join(root, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _module_name(root, path):
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def imported_modules(path, root=ROOT):
    """The modules of the package that the file ``path`` imports, anywhere in it, as dotted names.

    `from labs.m import x` names labs.m and, when x is a submodule (its file exists), labs.m.x too.
    Relative imports are resolved against the file's own package.
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    own = _module_name(root, path)
    package = own if path.endswith("__init__.py") else own.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level > 1:
                    parts = parts[:-(node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names
                      if _module_file(root, f"{base}.{alias.name}")}
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


def _with_parents(module):
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def core_files(root=ROOT, seeds=SEEDS):
    """Sorted paths (relative to ``root``, with /) of the seed files and everything they import in the
    package, each package's __init__.py included. An import of a module of the package that has no
    file raises ValueError (the browser would fail on it)."""
    todo = []
    for seed in seeds:
        full = os.path.join(root, seed)
        if seed.endswith("/"):
            todo += [os.path.join(d, f) for d, _, files in os.walk(full) for f in files if f.endswith(".py")]
        else:
            todo.append(full)
    done = set()
    while todo:
        path = os.path.normpath(todo.pop())
        if path in done:
            continue
        done.add(path)
        modules = imported_modules(path, root) | {_module_name(root, path)}
        for module in {p for m in modules for p in _with_parents(m)}:
            file = _module_file(root, module)
            if file is None:
                raise ValueError(f"{os.path.relpath(path, root)} imports {module}, which has no file "
                                 f"under {root}")
            todo.append(file)
    return sorted(os.path.relpath(p, root).replace(os.sep, "/") for p in done)


def write_zip(dest, root=ROOT, files=None):
    """The core files in a zip at ``dest`` (paths as in the repository, so `labs` sits at its top);
    the same sources give the same bytes. Returns the list of files."""
    files = core_files(root) if files is None else files
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
        for rel in files:
            info = zipfile.ZipInfo(rel, ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            with open(os.path.join(root, rel), "rb") as f:
                z.writestr(info, f.read())
    return files


if __name__ == "__main__":
    listed = write_zip(sys.argv[1]) if len(sys.argv) > 1 else core_files()
    print("\n".join(listed))
