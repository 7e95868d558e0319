"""Chapter 16: the grader every puzzle shares: carry the reader's function to the ranks, run it
through the book's launcher, and turn what went wrong into a sentence and a hint.

A function defined in a notebook cell lives in ``__main__``, which a spawned rank cannot import, so
`carry` takes its source (``inspect.getsource``; IPython keeps every cell's text) and the globals
it names: modules by their name, small constants by value, helpers the reader wrote in other cells
carried the same way. The rank compiles the source under a file name of its own, registered with
``linecache``, so a traceback and the launcher's heartbeat point at the reader's line. A function
that lives in an importable module (the book's own lab, the reference) travels by name.

`run` starts the ranks with `labs.launcher.launch.spawn` and a deadline: a rank that hangs is named
from its heartbeat with the call it waits in (``recv``, ``wait``, ``all_reduce``), a rank that
raises is named with its exception. Every answer is a `Grade`: ``pass: ...`` with what was
checked, or ``not yet: ...`` naming the difference, then ``hint: ...``. The hint of a hung run
follows its cause: a deadlock, a rank that returned early, a rank busy outside any communication
call, or ranks still starting (the machine, not the code). `exceeds` is the one comparison every
value check uses: NaN compares false, so ``err > bound`` would let a NaN pass. `nan_in` is the one
NaN branch every grader takes first, before its hints that name a cause: a NaN is named as a NaN.
"""
import ast
import dataclasses
import importlib
import inspect
import linecache
import os
import re
import textwrap
import types

import torch

from labs.launcher import launch

# What a puzzle's code may use without importing it (the statement of each puzzle says so).
PRELUDE = ("import math\nimport torch\nimport torch.distributed as dist\nimport torch.nn as nn\n"
           "import torch.nn.functional as F\nfrom labs.measure import comm\n")
WIDTH = 88  # the widest printed line the notebook page shows uncut
SIMPLE = (int, float, bool, str, bytes, type(None))


@dataclasses.dataclass
class Carried:
    """A function's source and the globals it names, rebuilt on a rank by `materialize`."""
    name: str
    source: str
    names: dict
    first_line: int = 1  # the def's line in the reader's file or cell: tracebacks count from there
    origin: str = "its cell"

    def materialize(self):
        namespace = {"__name__": f"puzzle_{self.name}"}
        exec(PRELUDE, namespace)
        for key, (kind, value) in self.names.items():
            if kind == "module":
                namespace[key] = importlib.import_module(value)
            elif kind == "object":
                namespace[key] = getattr(importlib.import_module(value[0]), value[1])
            elif kind == "carried":
                namespace[key] = value.materialize()
            else:
                namespace[key] = value
        filename = f"<your {self.name}>"
        lines = ["\n"] * (self.first_line - 1) + self.source.splitlines(True)
        linecache.cache[filename] = (len(self.source), None, lines, filename)
        tree = ast.parse(self.source)
        ast.increment_lineno(tree, self.first_line - 1)
        exec(compile(tree, filename, "exec"), namespace)
        return namespace[self.name]


def _importable(fn):
    module = getattr(fn, "__module__", None) or ""
    if not module.startswith("labs.") or "<locals>" in fn.__qualname__:
        return False
    found = importlib.import_module(module)
    for part in fn.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is fn


def _code_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def carry(fn, _seen=None):
    """``fn`` itself if a rank can import it by name, else a `Carried` copy of its source."""
    if not callable(fn):
        raise TypeError(f"the grader needs the function itself, got {type(fn).__name__}.")
    if _importable(fn):
        return fn
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        first = inspect.getsourcelines(fn)[1]
        path = inspect.getsourcefile(fn) or ""
    except (OSError, TypeError) as exc:
        raise ValueError(f"cannot read the source of {fn.__qualname__} ({exc}); define it with def in a "
                         "cell or a file.") from None
    seen = (_seen or set()) | {fn.__name__}
    names = {}
    for key in sorted(_code_names(fn.__code__) - seen):
        if key not in fn.__globals__:
            continue
        value = fn.__globals__[key]
        if isinstance(value, types.ModuleType):
            names[key] = ("module", value.__name__)
        elif isinstance(value, SIMPLE) or (isinstance(value, tuple)
                                           and all(isinstance(v, SIMPLE) for v in value)):
            names[key] = ("value", value)
        elif callable(value) and _importable_object(value):
            names[key] = ("object", (value.__module__, value.__qualname__))
        elif isinstance(value, types.FunctionType):
            names[key] = ("carried", carry(value, seen))
    cell = "ipykernel" in path or path.startswith("<") or not os.path.exists(path)
    return Carried(fn.__name__, source, names, max(first, 1), "its cell" if cell else os.path.basename(path))


def _origins(fn, out=None):
    """name -> where its lines are counted ("its cell" or a file name), for fn and its carried helpers."""
    out = {} if out is None else out
    if isinstance(fn, Carried):
        out[fn.name] = fn.origin
        for kind, value in fn.names.values():
            if kind == "carried":
                _origins(value, out)
    return out


def _importable_object(obj):
    module = getattr(obj, "__module__", None)
    if not module or module == "__main__" or "<locals>" in getattr(obj, "__qualname__", "<locals>"):
        return False
    try:
        return getattr(importlib.import_module(module), obj.__qualname__, None) is obj
    except ImportError:
        return False


def materialize(fn):
    """On a rank: the callable a `carry` sent."""
    return fn.materialize() if isinstance(fn, Carried) else fn


@dataclasses.dataclass
class Grade:
    """The grader's answer: passed or not, what was found, and a hint when it did not pass."""
    passed: bool
    lines: list
    hint: str = ""

    @property
    def text(self):
        """The answer, one line per finding (unwrapped)."""
        head = ("pass: " if self.passed else "not yet: ") + self.lines[0]
        rest = [f"  {line}" for line in self.lines[1:]]
        tail = [] if self.passed or not self.hint else [f"hint: {self.hint}"]
        return "\n".join([head, *rest, *tail])

    def __str__(self):  # wrapped to the notebook page's 88 columns
        return "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="    ", break_on_hyphens=False)
                         for line in self.text.splitlines())

    def __repr__(self):
        return str(self)

    def _repr_pretty_(self, printer, cycle):  # IPython shows it as text, not as a dataclass
        printer.text(str(self))


def exceeds(err, bound):
    """Where ``err`` is above ``bound`` or NaN: NaN compares false, so ``err > bound`` lets it pass."""
    return ~(err <= bound)


def worst(err, bound):
    """The flat index of the first NaN in ``err`` if there is one, else of the largest excess."""
    err = torch.as_tensor(err).reshape(-1)
    nan = torch.isnan(err).nonzero()
    if len(nan):
        return int(nan[0])
    return int((err - torch.as_tensor(bound).reshape(-1).expand_as(err)).argmax())


NAN_HINT = ("a NaN is never a rounding error: an operation on your rank made it. It usually comes from a "
            "division by a count that is zero, a softmax over a row that is all -inf (0/0), or a "
            "torch.empty buffer read before anything was written into it (or inf - inf).")


def nan_in(who, what, got, unit="element", rows=False, where=None):
    """A `Grade` naming the first NaN in ``got`` ("rank r's <what> <unit> i is NaN"), else None.
    ``who``: a rank number or a name; ``rows``: name the first row (dim 0) holding a NaN instead of
    the flat element; ``where(i)``: a note after the index."""
    if not isinstance(got, torch.Tensor) or not got.is_floating_point():
        return None
    nan = torch.isnan(got)
    nan = nan.reshape(nan.shape[0], -1).any(1) if rows and got.dim() else nan.reshape(-1)
    if not nan.any():
        return None
    i = int(nan.nonzero()[0])
    who = f"rank {who}" if isinstance(who, int) else who
    return Grade(False, [f"{who}'s {what} {unit} {i}{where(i) if where else ''} is NaN"], NAN_HINT)


def not_tensor(rank, got, shape, what="your function"):
    """A `Grade` when a rank's answer is not a tensor of ``shape``, else None."""
    if isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(shape):
        return None
    kind = (f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor)
            else "None" if got is None else f"a {type(got).__name__}")
    return Grade(False, [f"{what} returned {kind} on rank {rank}; the answer is a tensor of shape "
                         f"{tuple(shape)}"],
                 "return the result (a function without a return statement returns None).")


@launch.on_cpu("the puzzles are graded on gloo on every machine: the counted messages, the bytes and "
               "the peak memory are the CPU's, and a reader's tensors need not be on a device")
def _on_ranks(rank, world_size, module, check, fn, kwargs):
    """What every rank runs: rebuild the reader's function, then the puzzle's check on this rank."""
    return getattr(importlib.import_module(module), check)(rank, world_size, materialize(fn), **kwargs)


def run(check, fn, world_size, deadline, hint_hang, **kwargs):
    """Run ``check(rank, world_size, fn, **kwargs)`` on ranks; a list of per-rank results, or a `Grade`
    naming the rank that raised or hung, with a hint chosen by the cause (``hint_hang``: the
    puzzle's own, for a deadlock)."""
    carried = carry(fn) if callable(fn) else fn  # data travels as it is
    origins = _origins(carried)
    for attempt in range(2):
        try:
            return launch.spawn(_on_ranks, world_size, check.__module__, check.__name__, carried, kwargs,
                                timeout=deadline, backend="gloo")
        except launch.RankTimeout as exc:
            line, cause = _hang(exc, world_size, origins)
            if cause == "starting" and attempt == 0:
                continue  # the ranks never reached the reader's code: a slow start, run it once more
            return Grade(False, [f"deadline of {deadline:g} s passed: " + line], _HINTS.get(cause, hint_hang))
        except launch.RankError as exc:
            return Grade(False, [_raised(exc, origins)], _hint_raised(exc))


_HINTS = {
    "returned": ("every rank takes part in every step: a rank that returns before it has sent what its "
                 "peers wait for leaves them waiting forever."),
    "busy": ("that rank was running your code, outside any communication call: a loop that never ends, "
             "or work too slow for the deadline."),
    "starting": ("nothing in your code is at fault: the ranks had not all started by the deadline (a busy "
                 "machine); run the grader again, or pass it a larger deadline=..."),
}


def _at(found, origins):
    name, line = found[-1]
    return f" (your {name}, line {line} of {origins.get(name, 'its cell')})"


def _hang(exc, world_size, origins=None):
    """The launcher's verdict in one line, and its cause: which rank hung, which call it and the
    others wait in, the reader's line each stuck rank was on (from the stacks the launcher collected,
    each paired with the rank it names), and the ranks that already returned."""
    origins = origins or {}
    head, _, stacks = str(exc).partition("\n\n")
    parts = re.split(r"--- rank (\d+) was here ---", stacks)[1:]
    where = {}
    for rank, block in zip(parts[0::2], parts[1::2]):
        found = re.findall(r'File "<your (\w+)>", line (\d+)', block)
        if found:  # faulthandler lists the innermost call first
            where[int(rank)] = _at(found[:1], origins)
    returned = sorted(set(range(world_size)) - set(exc.ranks))
    late = re.findall(r"rank (\d+) of \d+ did not finish within [\d.]+ s: it (?:was still starting|had not "
                      r"started)", head)
    if late:
        return (f"rank{'s' if len(late) > 1 else ''} {_and(late)} had not finished starting (importing "
                "torch, joining the group): the machine was slow, not your code", "starting")
    deadlock = re.search(r"ranks (.*) of \d+ did not finish", head)
    if returned:
        stuck = ([s.split(" in ") for s in deadlock.group(1).split(", ")] if deadlock
                 else [[str(r), "a call"] for r in exc.ranks])
        return (f"rank{'s' if len(returned) > 1 else ''} {_and(returned)} returned while "
                + "; ".join(f"rank {r} waits in {c}{where.get(int(r), '')}" for r, c in stuck)
                + f": {'they' if len(returned) > 1 else 'it'} never sent what the others wait for",
                "returned")
    if deadlock and "deadlock" in head:
        stuck = [s.split(" in ") for s in deadlock.group(1).split(", ")]
        return ("every rank waits, none sends: a deadlock; " +
                "; ".join(f"rank {r} in {c}{where.get(int(r), '')}" for r, c in stuck)), "deadlock"
    cause = "busy" if "outside any collective" in head or "stopped running Python" in head else "deadlock"
    head = re.sub(r" did not finish within [\d.]+ s", " hung", head.replace("; all ranks were stopped.", ""))
    head = re.sub(r"\w+ \(<your (\w+)>:(\d+)\)",
                  lambda m: f"your {m[1]}, line {m[2]} of {origins.get(m[1], 'its cell')}", head)
    text = "; ".join(line.strip("() ") for line in head.splitlines())
    named = {int(r) for r in re.findall(r"rank (\d+) of \d+ hung: it was in your", text)}
    return text + "".join(f"; rank {r} was at{w}" for r, w in sorted(where.items()) if r not in named), cause


def _and(items):
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _raised(exc, origins=None):
    head, _, detail = str(exc).partition("\n\n")
    where = re.findall(r'File "<your (\w+)>", line (\d+)', detail)
    at = _at(where, origins or {}) if where else ""
    head = head.splitlines()[0]
    if " raised NotImplementedError" in head:  # a stub raises on every rank: which came first is luck
        head = "your function" + head[head.index(" raised"):]
    return head + at


def _hint_raised(exc):
    if "NotImplementedError" in str(exc).split("\n")[0]:
        return "replace the stub's raise with your code; the statement above says what each rank gets."
    if "SIGABRT" in str(exc).split("\n")[0]:
        return ("a rank aborted inside the communication library: most often a message whose size differs "
                "from the receive buffer posted for it (gloo aborts on that); check that each step sends and "
                "receives the same chunk, and that uneven chunks (comm.ring_chunks) are sized per index.")
    return "read the exception above: the line it names is in your function."
