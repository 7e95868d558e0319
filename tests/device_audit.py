"""A fake GPU for the CPU: run a lab's rank function as if the launcher had chosen NCCL.

On a GPU box `launch.device()` is the rank's GPU, and a tensor made without it stays on the CPU:
NCCL refuses it in a collective, and an operation that mixes it with a GPU tensor raises. On a
CPU both are CPU tensors, so the mistake never shows. This audit makes it show: inside a rank,
`launch.device()` returns ``GPU`` (``cpu:0``, a device that compares unequal to plain ``cpu``),
and every tensor made on ``GPU`` (a factory given ``device=GPU``, ``.to(GPU)``, ``.cuda()``, a
module moved with ``.to(GPU)``) is remembered by its storage; what an operation computes from such
a tensor is on ``GPU`` too, and its ``.device`` reads ``GPU``. Each of these is recorded as a
violation, with the lab's line that caused it, where a real GPU would raise:

- a collective (a ``c10d`` op) handed a CPU tensor of one or more dimensions;
- an operation mixing a GPU tensor with a CPU tensor of one or more dimensions (CUDA accepts a
  0-dimensional CPU tensor as a scalar, and ``copy_`` between devices is a copy, both allowed);
- a GPU tensor drawn from a CPU ``torch.Generator``;
- ``.numpy()`` of a GPU tensor.

Not caught: CUDA-only branches (``device.type == "cuda"``) do not run; a tensor that C++ code makes
from another tensor's options (DDP's buckets), or that torch.distributed's Python makes on its
mesh's device (FSDP2, DTensor), has no known device here and is never counted as a CPU tensor;
collectives that C++ code issues itself (DDP's Reducer) are not checked.
"""
import importlib
import sys
import time
import traceback

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GPU = torch.device("cpu", 0)
_MOVES = {"to", "cuda", "cpu", "new_tensor", "new_zeros", "new_ones", "new_empty", "new_full"}


def _plain(t):
    """The plain tensors behind ``t`` (a DTensor or another wrapper is opened up)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, n) for n in names]
    return [p for i in inner if isinstance(i, torch.Tensor) for p in _plain(i)]


def _key(t):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):   # a tensor without storage (meta, fake)
        return None


def _tensors(tree):
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _is_gpu(device):
    if device is None:
        return False
    device = torch.device(device) if isinstance(device, (str, int)) else device
    return device == GPU or device.type == "cuda"


class Audit:
    """The tags and the violations of one rank."""

    def __init__(self):
        self.tagged, self.violations, self.quiet = {}, [], False
        self.unknown = {}         # made by C++ code from a tensor's options: its device is not known here
        self.factories = 0        # > 0 while a Python factory (torch.zeros, torch.tensor, ...) runs

    @staticmethod
    def _has(tags, t):
        return any((ref := tags.get(_key(p))) is not None and not ref.expired() for p in _plain(t))

    @staticmethod
    def _add(tags, tree):
        # a weak reference keeps the storage's record alive (not its memory), so no later storage
        # can take its address while the tag exists, and expired() says when the storage was freed
        for t in _tensors(tree):
            for p in _plain(t):
                if (k := _key(p)) is not None:
                    tags[k] = StorageWeakRef(p.untyped_storage())

    def on_gpu(self, t):
        return self._has(self.tagged, t)

    def tag(self, tree):
        self._add(self.tagged, tree)

    def untag(self, tree):
        for t in _tensors(tree):
            for p in _plain(t):
                self.tagged.pop(_key(p), None)

    def host(self, tensors):
        """The CPU tensors that a GPU would refuse: not tagged, at least one dimension."""
        return [t for t in tensors if t.dim() > 0 and t.device.type == "cpu" and not self.on_gpu(t)
                and not self._has(self.unknown, t)]

    def violation(self, what):
        here = [f"{f.filename.split('/labs/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                if "/labs/" in f.filename and "/labs/launcher/" not in f.filename]
        self.violations.append(f"{what} (at {', '.join(here[-3:]) or 'outside labs'})")


_SKIP = ("device_audit.py", "torch/_dynamo/", "torch/_compile.py", "torch/utils/_python_dispatch.py")


def _from_python_api():
    """Whether a collective came from torch's Python API (dist.all_reduce, the functional
    collectives), where the caller's tensor is what NCCL gets. C++ code (DDP's Reducer and
    parameter checks) makes its own tensors on its parameters' device, which the audit cannot
    see as the GPU; the object collectives put their buffers on the backend's device; both
    are left out."""
    frames = [f for f in traceback.extract_stack() if not any(s in f.filename for s in _SKIP)]
    if any("distributed_c10d.py" in f.filename and "object" in f.name for f in frames):
        return False
    inner = frames[-1].filename if frames else ""
    return "distributed_c10d.py" in inner or "_functional_collectives" in inner


def _from_torch_distributed():
    """Whether the nearest caller outside torch's dispatch machinery is torch.distributed's own code
    (FSDP2, DTensor, pipelining): it puts tensors on its mesh's device, which the audit sees as the
    CPU where a GPU box has the GPU, so what it makes has no known device and its moves keep tags."""
    frame = sys._getframe(2)
    while frame is not None and any(s in frame.f_code.co_filename for s in _SKIP + ("torch/overrides.py",)):
        frame = frame.f_back
    return frame is not None and "torch/distributed/" in frame.f_code.co_filename


class _Functions(TorchFunctionMode):
    """Where a tensor goes to the GPU: factories with ``device=``, moves, and ``.device``."""

    def __init__(self, audit):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        a = self.audit
        if getattr(func, "__self__", None) is torch.Tensor.device:    # reading ``t.device``
            return GPU if a.on_gpu(args[0]) and not _from_torch_distributed() else func(*args)
        if name == "numpy" and a.on_gpu(args[0]):
            a.violation(f".numpy() of a GPU tensor {tuple(args[0].shape)}")
        device = kwargs.get("device")
        if name in ("to", "cuda") and isinstance(args[0], torch.Tensor):
            wanted = kwargs.get("device") or next((x for x in args[1:] if isinstance(x, (str, torch.device))),
                                                  None)
            device = GPU if name == "cuda" else wanted
        factory = not _tensors((args, kwargs))
        a.factories += factory
        try:
            out = func(*args, **kwargs)
        finally:
            a.factories -= factory
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        library = not _is_gpu(device) and (factory or name in _MOVES) and _from_torch_distributed()
        if library:     # made, or moved to its mesh's device, by torch.distributed: device unknown
            if factory or (source is not None and not a.on_gpu(source)):
                a._add(a.unknown, out)
        elif _is_gpu(device):
            gen = kwargs.get("generator")
            if gen is not None and gen.device.type == "cpu":
                a.violation(f"{name} on the GPU drawn from a CPU torch.Generator")
            if source is not None and not a.on_gpu(source) and isinstance(out, torch.Tensor) \
                    and _key(out) == _key(source):
                out = out.clone()      # a real move makes a new tensor: never tag the CPU original
            a.tag(out)
        elif name in _MOVES and source is not None and isinstance(out, torch.Tensor):
            if (name == "cpu" or (name == "to" and device is not None)) and a.on_gpu(source):
                if _key(out) == _key(source):
                    a.quiet = True     # back on the CPU: a new tensor, untagged
                    try:
                        out = out.clone()
                    finally:
                        a.quiet = False
                else:
                    a.untag(out)
            elif name.startswith("new_") and a.on_gpu(source):
                a.tag(out)
        return out


_CPU_INDICES = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default,
                torch.ops.aten.index_put.default, torch.ops.aten._index_put_impl_.default)


class _Ops(TorchDispatchMode):
    """What each operation computes from GPU tensors is on the GPU; a CPU tensor beside one is a violation."""

    def __init__(self, audit):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a = self.audit
        tensors = _tensors((args, kwargs))
        gpu = [t for t in tensors if a.on_gpu(t)]
        if func in _CPU_INDICES:      # x[idx]: CUDA takes CPU indices and moves them itself
            checked = [t for t in tensors if not any(t is i for i in _tensors(args[1]))]
        else:
            checked = tensors
        namespace = func.namespace
        collective = namespace in ("c10d", "_c10d_functional", "c10d_functional")
        if collective and _from_python_api():
            for t in a.host(tensors):
                a.violation(f"{func} handed a CPU tensor {tuple(t.shape)}")
        elif not collective and gpu and func not in (torch.ops.aten.copy_.default,
                                                     torch.ops.aten._to_copy.default):
            for t in a.host(checked):
                a.violation(f"{func} mixes a GPU tensor with a CPU tensor {tuple(t.shape)}")
        out = func(*args, **kwargs)
        if a.quiet:
            return out
        if not tensors and not a.factories:   # made in C++ (DDP's buckets, say): device unknown
            a._add(a.unknown, out)
            return out
        if gpu:     # a move back to the CPU (``.cpu()``, ``.to("cpu")``) is untagged by _Functions
            a.tag(out)
        elif any(a._has(a.unknown, t) for t in tensors):
            a._add(a.unknown, out)
        return out


def run(rank, world_size, module, name, args=(), kwargs=None):
    """Run ``module.name(rank, world_size, *args, **kwargs)`` as on a GPU: the violations and the result."""
    from labs.launcher import launch
    launch.device = lambda: GPU
    fn = getattr(importlib.import_module(module), name)
    audit = Audit()
    with _Functions(audit), _Ops(audit):
        result = fn(rank, world_size, *args, **(kwargs or {}))
    return {"violations": audit.violations[:20], "count": len(audit.violations), "result": result}


def run_many(rank, world_size, specs):
    """`run` for each (``"module.function"``, args, kwargs) in one start of the ranks:
    {name: (number of violations, the first few, seconds it took)}."""
    out = {}
    for name, args, kwargs in specs:
        module, _, fn = name.rpartition(".")
        start = time.perf_counter()
        r = run(rank, world_size, module, fn, args, kwargs)
        out[name] = (r["count"], r["violations"], round(time.perf_counter() - start, 1))
    return out
