"""labs/ is the book's table of contents: one package per chapter over shared packages, with every
import pointing one way (issue 27).

The import graph is read from the source with `ast`, function-level imports included (an import
inside a function that closes a circle is still a circle), and checked for: no circle among
modules; the shared packages (launcher, measure) and the top-level modules importing no chapter;
a chapter importing only shared pieces and earlier chapters; no file over 320 lines; at most three
modules loose in labs/; a docstring in every package's __init__.py that names its chapter and
says what each of its modules is for; one home for the degrees, the model shape, the stage split
and the DeviceMesh (issue 35: four copies of the degrees had drifted apart); no package using another
package's underscore names, and labs/__init__.py's table of contents listing every package with its
chapter (issue 37). The synthetic cases at the end show each rule can fail.
"""
import ast
import os
import re

import pytest

LABS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "labs")
MAX_LINES = 320
MAX_LOOSE = 3
SHARED = {"labs.launcher", "labs.measure", "labs.formulas"}   # what every chapter uses
TOP = {"labs.model", "labs.groups", "labs.dims"}      # the tiny model, the degrees, their process groups
APPS = {"labs.gpu"}                                   # commands on top of the chapters; nothing imports them
# A chapter that uses a later chapter's lab, each with the reason; the later one never imports it back
# (test_a_later_chapter_used_earlier_never_imports_it_back).
LATER_OK = {("labs.profiling", "labs.threed"): "chapter 15 profiles the 3D run that chapter 17 builds and "
                                               "proves; chapter 17 uses nothing of chapter 15"}
CHAPTERS = {"labs.memory_budget": 1, "labs.data_parallel": 2, "labs.zero": 3, "labs.tensor_parallel": 4,
            "labs.pipeline": 5, "labs.context_parallel": 6, "labs.expert_parallel": 7, "labs.precision": 8,
            "labs.recompute": 9, "labs.collectives": 10, "labs.hardware": 11, "labs.checkpointing": 12,
            "labs.failures": 13, "labs.planning": 14,
            "labs.profiling": 15, "labs.puzzles": 16,
            "labs.threed": 17}


# ---- the graph ------------------------------------------------------------------------------------

def read_tree(root=LABS):
    """{module name: (path, source)} for every .py file under ``root`` (packages as their name)."""
    base = os.path.dirname(root)
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                name = name[:-len(".__init__")] if name.endswith(".__init__") else name
                with open(path, encoding="utf-8") as fh:
                    out[name] = (path, fh.read())
    return out


def import_base(package, node):
    """The absolute module an ``ast.ImportFrom`` reads from, inside ``package`` (relative imports too)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    return ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))


def imports(name, source, modules, is_package=False):
    """The modules of ``modules`` that ``name`` imports anywhere in ``source`` (functions included)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = import_base(package, node)
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    found.add(f"{base}.{a.name}")
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def graph(sources, packages=()):
    """{module: set of modules it imports} for {module: source}; ``packages`` lists the __init__ ones."""
    return {m: imports(m, src, sources, m in packages) for m, src in sources.items()}


def circles(edges):
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in edges:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def package_of(module):
    """labs.zero.stages -> labs.zero; labs.model -> labs.model; labs -> labs."""
    parts = module.split(".")
    return ".".join(parts[:2])


def backward_edges(edges):
    """Every import that points the wrong way, as (importer, imported, why)."""
    bad = []
    for src, targets in sorted(edges.items()):
        here = package_of(src)
        for dst in sorted(targets):
            there = package_of(dst)
            if there == here:
                continue
            if there in APPS:
                bad.append((src, dst, f"nothing imports {there}, a command on top of the chapters"))
            elif here in SHARED or here in TOP or here == "labs":
                if there not in SHARED and there not in TOP:
                    bad.append((src, dst, f"{here} is shared by every chapter and imports none"))
            elif here in CHAPTERS:
                if (here, there) in LATER_OK:
                    continue
                if there in CHAPTERS and CHAPTERS[there] >= CHAPTERS[here]:
                    bad.append((src, dst, f"chapter {CHAPTERS[here]} imports chapter {CHAPTERS[there]}"))
                elif there not in CHAPTERS and there not in SHARED and there not in TOP:
                    bad.append((src, dst, f"{there} is neither shared nor a chapter"))
    return bad


TREE = read_tree()
PACKAGES = {m for m, (path, _) in TREE.items() if path.endswith("__init__.py")}
EDGES = graph({m: src for m, (_, src) in TREE.items()}, PACKAGES)


# ---- the rules, on labs/ -------------------------------------------------------------------------

def test_no_import_circle():
    assert circles(EDGES) == []


def test_imports_point_from_later_chapters_to_earlier_ones_and_shared_packages():
    assert backward_edges(EDGES) == []


def test_a_later_chapter_used_earlier_never_imports_it_back():
    back = [(s, d) for s, ds in EDGES.items() for d in ds
            if (package_of(d), package_of(s)) in LATER_OK]
    assert back == []


def test_every_package_is_a_known_chapter_or_shared():
    known = SHARED | APPS | set(CHAPTERS)
    # a package inside a known one (the core's planner, labs.formulas.planning) is part of it
    assert sorted(p for p in PACKAGES if p != "labs" and package_of(p) not in known) == []


def test_no_file_over_320_lines():
    long = {os.path.relpath(path, LABS): src.count("\n") for path, src in TREE.values()
            if src.count("\n") > MAX_LINES}
    assert long == {}


def test_at_most_three_modules_loose_in_labs():
    loose = sorted(f for f in os.listdir(LABS) if f.endswith(".py") and f != "__init__.py")
    assert len(loose) <= MAX_LOOSE, loose
    assert {f"labs.{f[:-3]}" for f in loose} <= TOP


@pytest.mark.parametrize("package", sorted(PACKAGES - {"labs"}))
def test_package_docstring_names_its_chapter_and_every_module(package):
    doc = ast.get_docstring(ast.parse(TREE[package][1])) or ""
    if package in CHAPTERS:
        assert f"Chapter {CHAPTERS[package]}" in doc.split("\n")[0], doc.split("\n")[0]
    else:
        assert "chapter" in doc.lower(), doc
    modules = sorted(m.rpartition(".")[2] for m in TREE if m.startswith(package + ".") and m.count(".") == 2)
    missing = [m for m in modules if f"`{m}`" not in doc and f"`{m}.py`" not in doc]
    assert missing == [], f"{package}/__init__.py does not say what these modules are for: {missing}"


# ---- a name another package uses is public; the table of contents is whole (issue 37) --------------

def private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def underscore_uses(sources, packages=()):
    """(module, line, "module.name") for every use of an underscore name of a module in another package:
    imported by name (``from labs.zero.fsdp import _x``) or read off the module (``fsdp._x``,
    ``labs.zero.fsdp._x``). A module's own package may use its underscore names; dunders are public."""
    found = []
    for name, source in sources.items():
        package = name if name in packages else name.rpartition(".")[0]
        tree = ast.parse(source)
        alias = {}                            # local name -> the labs module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                alias.update({a.asname: a.name for a in node.names if a.asname and a.name in sources})
            elif isinstance(node, ast.ImportFrom):
                base = import_base(package, node)
                for a in node.names:
                    if f"{base}.{a.name}" in sources:
                        alias[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in sources and private(a.name):
                        found.append((name, node.lineno, f"{base}.{a.name}"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                owner = alias.get(ast.unparse(node.value), ast.unparse(node.value))
                if owner in sources:
                    found.append((name, node.lineno, f"{owner}.{node.attr}"))
    return sorted(f for f in found if package_of(f[2].rpartition(".")[0]) != package_of(f[0]))


def test_no_package_uses_another_packages_underscore_names():
    assert underscore_uses({m: src for m, (_, src) in TREE.items()}, PACKAGES) == []


def contents_missing(source, names):
    """The packages and loose modules of ``names`` that the docstring of labs/__init__.py (``source``)
    leaves out: a chapter as ``zero/  chapter 3`` (its number right), any other package as
    ``launcher/``, a loose module as ``model.py``."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    missing = []
    for m in sorted(names):
        short = m.split(".")[1]
        if m in CHAPTERS:
            listed = re.search(rf"(?<![\w/]){short}/\s+chapter {CHAPTERS[m]}(?!\d)", doc)
        else:
            listed = re.search(rf"(?<![\w/]){short}{'/' if m in PACKAGES else '.py'}", doc)
        if not listed:
            missing.append(m)
    return missing


LISTED = (PACKAGES - {"labs"}) | set(CHAPTERS) | {m for m in TREE if m.count(".") == 1 and m not in PACKAGES}


def test_labs_init_lists_every_package_with_its_chapter():
    assert contents_missing(TREE["labs"][1], LISTED) == []


UNDERSCORES = {
    "imported by name": ({"labs.checkpointing.c": "from labs.zero.fsdp import _name\n",
                          "labs.zero.fsdp": ""}, ["labs.zero.fsdp._name"]),
    "read off a module": ({"labs.gpu.r": "from labs.launcher import cli\nx = cli._plain(1)\n",
                           "labs.launcher.cli": ""}, ["labs.launcher.cli._plain"]),
    "read off an alias": ({"labs.zero.h": "import labs.measure.wire as w\nw._wchar()\n",
                           "labs.measure.wire": ""}, ["labs.measure.wire._wchar"]),
    "read off the full path": ({"labs.zero.h": "import labs.measure.wire\nlabs.measure.wire._wchar()\n",
                                "labs.measure.wire": ""}, ["labs.measure.wire._wchar"]),
    "a relative import in a function": ({"labs.context_parallel.s": "def f():\n"
                                         "    from ..tensor_parallel.megatron import _logs\n",
                                         "labs.tensor_parallel.megatron": ""},
                                        ["labs.tensor_parallel.megatron._logs"]),
    "the module's own package": ({"labs.zero.a": "from labs.zero import b\nfrom labs.zero.b import _y\n"
                                                 "b._x()\n", "labs.zero.b": ""}, []),
    "dunders and other libraries": ({"labs.zero.a": "import torch.utils._pytree as pt\n"
                                                    "from labs.zero import b\n"
                                                    "print(b.__name__, pt._x, pt.tree_map)\n",
                                     "labs.zero.b": ""}, []),
}


@pytest.mark.parametrize("case", sorted(UNDERSCORES))
def test_a_use_of_another_packages_underscore_name_is_caught(case):
    sources, caught = UNDERSCORES[case]
    assert [use for _, _, use in underscore_uses(sources)] == caught


def test_a_package_left_out_of_the_table_of_contents_is_caught():
    source = TREE["labs"][1]
    assert contents_missing(source.replace("zero/", "zer0/"), LISTED) == ["labs.zero"]
    assert contents_missing(source.replace("chapter 3", "chapter 33"), LISTED) == ["labs.zero"]
    assert contents_missing(source.replace("launcher/", "launch/"), LISTED) == ["labs.launcher"]
    assert contents_missing(source.replace("dims.py", "degrees.py"), LISTED) == ["labs.dims"]


# ---- one home per idea (issue 35) -------------------------------------------------------------------

DEGREES = {"dp", "tp", "pp", "cp", "ep"}
HOMES = {"degrees": "labs.dims", "model shape": "labs.formulas.shape",
         "stage split": "labs.formulas.stages", "device mesh": "labs.groups",
         "placement rule": "labs.dims"}


def second_homes(sources):
    """(idea, module) for every module other than the idea's home that defines it again: a dataclass
    with two or more degree fields, a dataclass with a model's layers and hidden size, a stage split
    (``stage_layers`` or ``split_counts``), a call of ``init_device_mesh``, a tier rule (``tier_of``)."""
    found = set()
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d)
                                                      for d in node.decorator_list):
                fields = {t.target.id for t in node.body
                          if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
                if len(fields & DEGREES) >= 2:
                    found.add(("degrees", name))
                if {"layers", "hidden"} <= fields:
                    found.add(("model shape", name))
            elif isinstance(node, ast.FunctionDef) and node.name in ("stage_layers", "split_counts"):
                found.add(("stage split", name))
            elif isinstance(node, ast.FunctionDef) and node.name == "tier_of":
                found.add(("placement rule", name))
            elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "init_device_mesh":
                found.add(("device mesh", name))
    return sorted((idea, m) for idea, m in found if HOMES[idea] != m)


def test_degrees_model_shape_stage_split_and_mesh_have_one_home():
    assert second_homes({m: src for m, (_, src) in TREE.items()}) == []


def test_the_homes_define_what_they_are_home_to():
    homes = {m: TREE[m][1] for m in set(HOMES.values())}
    assert "class ParallelDims" in homes["labs.dims"] and "init_device_mesh(" in homes["labs.groups"]
    assert "class ModelShape" in homes["labs.formulas.shape"]
    assert "def stage_layers" in homes["labs.formulas.stages"]


SECOND_HOMES = {
    "a Plan with its own degrees": ("from dataclasses import dataclass\n@dataclass\nclass Plan:\n"
                                    "    dp: int\n    tp: int = 1\n",
                                    ("degrees", "labs.formulas.planning.memory")),
    "the older tier rule": ("def tier_of(stride, n, g):\n    return stride * n <= g\n",
                            ("placement rule", "labs.hardware.placement")),
    "a mesh built by hand": ("from torch.distributed.device_mesh import init_device_mesh\n"
                             "m = init_device_mesh('cpu', (2,))\n", ("device mesh", "labs.zero.stages")),
    "a second model type": ("import dataclasses\n@dataclasses.dataclass(frozen=True)\nclass Arch:\n"
                            "    layers: int\n    hidden: int\n",
                            ("model shape", "labs.memory_budget.budget")),
    "a second split": ("def split_counts(n, parts):\n    return [n // parts] * parts\n",
                       ("stage split", "labs.formulas.planning.memory")),
}


@pytest.mark.parametrize("case", sorted(SECOND_HOMES))
def test_a_second_home_is_caught(case):
    source, (idea, module) = SECOND_HOMES[case]
    assert second_homes({module: source, HOMES[idea]: source}) == [(idea, module)]


# ---- the checks can fail -------------------------------------------------------------------------

SYNTHETIC = {
    "a circle": ({"labs.measure.a": "from labs.measure import b\n",
                  "labs.measure.b": "from labs.measure import a\n"}, "circle"),
    "a circle hidden in a function": ({"labs.zero.x": "from labs.zero import y\n",
                                       "labs.zero.y": "def f():\n    from labs.zero.x import g\n"
                                                      "    return g\n"},
                                      "circle"),
    "a circle through a third module": ({"labs.pipeline.p": "import labs.pipeline.q\n",
                                         "labs.pipeline.q": "from labs.pipeline import r\n",
                                         "labs.pipeline.r": "from . import p\n"}, "circle"),
    "chapter 2 importing chapter 8": ({"labs.data_parallel.d": "from labs.precision import fp8\n",
                                       "labs.precision.fp8": ""}, "backward"),
    "a chapter importing itself from a later one": ({"labs.zero.s":
                                                     "from labs.tensor_parallel.megatron import f\n",
                                                     "labs.tensor_parallel.megatron": ""}, "backward"),
    "measurement importing a chapter": ({"labs.measure.comm": "def f():\n"
                                                              "    from labs.data_parallel import ring\n",
                                         "labs.data_parallel.ring": ""}, "backward"),
    "a chapter importing the GPU command": ({"labs.failures.f": "from labs.gpu import record\n",
                                             "labs.gpu.record": ""}, "backward"),
    "one way": ({"labs.zero.s": "from labs.data_parallel import ring\nfrom labs.measure import comm\n",
                 "labs.data_parallel.ring": "from labs.measure import comm\nfrom labs import model\n",
                 "labs.measure.comm": "from labs.measure import wire\n", "labs.measure.wire": "",
                 "labs.model": "", "labs.gpu.record": "from labs.zero import s\n"}, None),
}


@pytest.mark.parametrize("case", sorted(SYNTHETIC))
def test_the_rules_catch_a_circle_and_a_backward_edge(case):
    sources, caught = SYNTHETIC[case]
    edges = graph(sources)
    found = {"circle": bool(circles(edges)), "backward": bool(backward_edges(edges))}
    assert found == {"circle": caught == "circle", "backward": caught == "backward"}, (edges, found)
