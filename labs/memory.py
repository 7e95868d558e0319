"""Honest byte accounting of what a rank holds (chapter 1 and every chapter after it).

Bytes are read from tensor storages, each storage counted once: a view or a flat buffer shared by
many parameters costs what it really allocates, and a DTensor counts only its local shard. RSS is
far too noisy for the lessons (hundreds of MiB of interpreter and library per process); storages
are exact. On a GPU, ``torch.cuda.max_memory_allocated`` is reported beside them.
"""
import contextlib

import torch


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


def _tensors(obj):
    """Every tensor inside nested dicts, lists and tuples (an optimizer's state, say)."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


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
        list(_tensors(optimizer.state)) if optimizer is not None else [])
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


def cuda_peak_bytes():
    """Peak bytes allocated on this rank's GPU, or None on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    return None
