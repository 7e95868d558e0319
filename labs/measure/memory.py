"""Honest byte accounting of what a rank holds (chapter 1 and every chapter after it).

Two numbers with two lessons:
- steady state (`state_bytes`, `storage_bytes`): what a rank keeps between steps, read from tensor
  storages, each storage counted once: a view or a flat buffer shared by many parameters costs what
  it really allocates, and a DTensor counts only its local shard;
- the peak during a step (`PeakMemory`): the high-water mark of live storages while a block runs,
  which is what ZeRO, FSDP, recomputation and pipeline schedules actually lower.

RSS is far too noisy for the lessons (hundreds of MiB of interpreter and library per process);
storages are exact. On a GPU, ``torch.cuda.max_memory_allocated`` is reported beside them.
"""
import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


def _storage(t):
    if hasattr(t, "to_local"):  # DTensor: this rank holds only its local shard
        t = t.to_local()
    return t.untyped_storage()


def storage_bytes(tensors, seen=None):
    """Bytes of the distinct storages behind ``tensors``; storages in ``seen`` are skipped and added."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        s = _storage(t)
        key = (s.device, s.data_ptr())
        if key not in seen and s.nbytes() > 0:
            seen.add(key)
            total += s.nbytes()
    return total


def tensors_in(obj):
    """Every tensor inside nested dicts, lists and tuples (an optimizer's state, say)."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def state_bytes(model, optimizer=None):
    """Bytes this rank holds between steps, by category.

    parameters: the working weights the model computes with; gradients: ``.grad`` plus any
    gradient buffer the optimizer keeps (``main_grad``); optimizer_state: everything else the
    optimizer holds (fp32 master weights, Adam's m and v). A storage is counted in the first
    category that reaches it, so a recipe whose optimizer updates the model's own weights
    (plain fp32 Adam) does not count them twice.
    """
    seen = set()
    params = list(model.parameters())
    out = {"parameters": storage_bytes(params, seen)}
    grads = [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params]
    out["gradients"] = storage_bytes(grads, seen)
    state = optimizer.state_dict_tensors() if hasattr(optimizer, "state_dict_tensors") else (
        list(tensors_in(optimizer.state)) if optimizer is not None else [])
    out["optimizer_state"] = storage_bytes(state, seen)
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer_state"]
    return out


class SavedTensors:
    """What autograd keeps for backward, recorded by storage (see `saved_for_backward`)."""

    def __init__(self, exclude):
        self.exclude = exclude
        self.storages = {}  # key -> (nbytes, dtype, shape of the first tensor seen)

    def pack(self, t):
        s = _storage(t)
        key = (s.device, s.data_ptr())
        if key not in self.exclude and key not in self.storages:
            self.storages[key] = (s.nbytes(), t.dtype, tuple(t.shape))
        return t

    @property
    def bytes(self):
        return sum(n for n, _, _ in self.storages.values())

    def by_dtype(self):
        out = {}
        for n, dtype, _ in self.storages.values():
            out[str(dtype)] = out.get(str(dtype), 0) + n
        return out


@contextlib.contextmanager
def saved_for_backward(module=None):
    """Record the activations autograd saves inside the block.

    Parameters (and their transposed views, which share storage) are left out: they are counted
    as parameters, not activations.
    """
    exclude = set()
    if module is not None:
        for t in list(module.parameters()) + list(module.buffers()):
            s = _storage(t)
            exclude.add((s.device, s.data_ptr()))
    record = SavedTensors(exclude)
    with torch.autograd.graph.saved_tensors_hooks(record.pack, lambda t: t):
        yield record


def _cuda_in_use():
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def reset_cuda_peak():
    """Start this rank's CUDA high-water mark afresh, once the work already queued is done: call it
    right before the step whose peak `cuda_peak_bytes` should report. Nothing on the CPU."""
    if _cuda_in_use():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def cuda_peak_bytes():
    """Peak bytes allocated on this rank's GPU since the last `reset_cuda_peak` (else since the
    process started), once the queued work is done; None on the CPU."""
    if _cuda_in_use():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return None


def _storages(t):
    """The storages behind ``t``; a tensor subclass (DTensor, FSDP2's wrappers) is opened up."""
    todo, out = [t], []
    while todo:
        t = todo.pop()
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            todo.extend(getattr(t, a) for a in attrs if torch.is_tensor(getattr(t, a)))
        elif t.device.type != "meta" and t.layout == torch.strided:
            out.append(t.untyped_storage())
    return out


class PeakMemory(TorchDispatchMode):
    """The high-water mark of live tensor storage while a block runs (chapters 3, 5, 6, 7).

        with memory.PeakMemory(model, optimizer) as mem:
            loss = model(x, y); loss.backward(); optimizer.step()
        mem.peak_bytes, mem.baseline_bytes

    Every ATen operator call inside the block passes through ``__torch_dispatch__``; each storage an
    operator takes or returns that was not seen before counts from that moment until Python frees
    it (a weak reference's callback), so temporaries count while they live.
    ``UntypedStorage.resize_`` is not an operator, so it is wrapped while the block runs: a storage
    shrunk to 0 bytes (FSDP's free) stops counting, one grown again counts again.

    The baseline, reported separately as ``baseline_bytes``, is the storages of the ``external``
    objects (modules with their gradients and buffers, optimizers, tensors, nested lists) when the
    block starts: pass everything the step starts with. Their later growth, shrinking and freeing
    count like any allocation. ``peak_bytes`` = ``baseline_bytes`` + the highest net allocation.
    A storage that is not external and not made by an operator of this thread is counted from its
    first use: an old tensor not passed as external (counted then, not from the start), or a
    buffer a collective allocated on its own thread (gloo's reduce-scatter all-reduces a full-size
    copy of its input, which the main thread then splits: it counts from that split).

    What it cannot see: memory allocated outside ATen, or on another thread and never handed to
    this one (gloo's and NCCL's internal buffers, Python objects, the allocator's cache of freed
    blocks); allocator rounding (the CUDA caching allocator rounds each allocation up to a multiple
    of 512 bytes); workspaces created and freed inside one operator; operators run on other
    threads (the dispatch mode is thread-local; CPU autograd runs on the calling thread). On a
    GPU, ``cuda_peak_bytes`` (``torch.cuda.max_memory_allocated`` over the block) is the
    allocator's own answer, rounding and workspaces included; None on the CPU.
    """

    def __init__(self, *external, timeline=False):
        super().__init__()
        self.external = external
        self.live = {}              # storage id -> [weak reference, bytes it counts now]
        self.net = 0                # bytes allocated in the block minus bytes freed, so far
        self.peak_net = 0
        self.baseline_bytes = 0
        self.peak_op = None         # the operator during which the peak was reached
        self._op, self._active = None, False
        self.timeline = [] if timeline else None  # net bytes after every operator, in order
        self.cuda_peak_bytes = self.cuda_baseline_bytes = None

    # -- bookkeeping ------------------------------------------------------------------------
    def _track(self, storage, baseline):
        key = storage._cdata
        if key in self.live:
            return
        nbytes = storage.nbytes()
        if baseline:
            self.baseline_bytes += nbytes   # it was already there: baseline, not an allocation
        else:
            self._change(nbytes)
        self.live[key] = [weakref.ref(storage, lambda _, key=key: self._freed(key)), nbytes]

    def _freed(self, key):
        entry = self.live.pop(key, None)
        if entry is not None and self._active:
            self._change(-entry[1])

    def _change(self, delta):
        self.net += delta
        if self.net > self.peak_net:
            self.peak_net, self.peak_op = self.net, self._op

    def _resized(self, storage):
        entry = self.live.get(storage._cdata)
        if entry is not None:
            self._change(storage.nbytes() - entry[1])
            entry[1] = storage.nbytes()

    # -- the dispatch mode --------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = str(func)
        inputs, _ = tree_flatten((args, kwargs or {}))
        for t in inputs:
            if isinstance(t, torch.Tensor):
                for s in _storages(t):
                    self._track(s, baseline=False)
        out = func(*args, **(kwargs or {}))
        outputs, _ = tree_flatten(out)
        for t in outputs:
            if isinstance(t, torch.Tensor):
                for s in _storages(t):
                    self._track(s, baseline=False)
        if self.timeline is not None:
            self.timeline.append(self.net)
        return out

    def __enter__(self):
        for t in _tensors_of(self.external):
            for s in _storages(t):
                self._track(s, baseline=True)
        self._resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(storage, size):
            mode._op = "UntypedStorage.resize_"
            out = mode._resize(storage, size)
            if storage._cdata in mode.live:
                mode._resized(storage)
            else:                                  # unknown until now: counts from its new size
                mode._track(storage, baseline=False)
            return out

        torch.UntypedStorage.resize_ = resize_
        if _cuda_in_use():
            reset_cuda_peak()
            self.cuda_baseline_bytes = torch.cuda.memory_allocated()
        self._active = True
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        self._active = False   # later frees no longer change the results
        self.live.clear()
        if self.cuda_baseline_bytes is not None:
            self.cuda_peak_bytes = cuda_peak_bytes()
        return super().__exit__(*exc)

    # -- results ------------------------------------------------------------------------------
    @property
    def peak_bytes(self):
        """Highest live bytes in the block: the baseline plus the highest net allocation."""
        return self.baseline_bytes + self.peak_net

    @property
    def end_bytes(self):
        """Live bytes when the block ended (baseline + allocations still alive - frees)."""
        return self.baseline_bytes + self.net

    def result(self):
        """A plain dict for a lab's result: peak, baseline, end, the peak's operator, CUDA's peak."""
        out = {"peak_bytes": self.peak_bytes, "baseline_bytes": self.baseline_bytes,
               "peak_above_baseline_bytes": self.peak_net, "end_bytes": self.end_bytes,
               "peak_op": self.peak_op, "cuda_peak_bytes": self.cuda_peak_bytes}
        if self.timeline is not None:
            out["timeline"] = list(self.timeline)
        return out


def _tensors_of(objs):
    """Every tensor of modules (parameters, buffers, gradients), optimizers (state) and tensors."""
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            yield from tensors_in(obj.state)
        elif hasattr(obj, "state_tensors"):   # a hand optimizer that lists what it holds
            yield from obj.state_tensors()
        else:
            yield from tensors_in(obj)
