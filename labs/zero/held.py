"""Chapter 3: what a rank holds between steps, counted two ways.

`held_bytes` sums the storages of the weights, gradients and optimizer state by category, each
storage once; `reachable_bytes` sums every storage reachable from the model, the optimizer and the
hand FSDP, its cross-check: a gathered weight never freed, or a copy cached in another attribute,
shows as a difference between the two. `stages` measures every ZeRO stage with them.
"""
import types

import torch

from labs.measure import memory
from labs.zero.sharded_optimizer import ShardedOptimizer


def held_bytes(net, opt):
    """Bytes a rank holds between steps, by category, storages counted once. Adam's step counters
    (a 4-byte scalar per parameter tensor) are reported beside them, outside ``total``. Stage 3 (as
    FSDP2) keeps fp32 shards that are their own master copy: parameters 4/N, fp32 gradient shard 4/N,
    m and v 8/N bytes per parameter, where the ZeRO paper splits the same 16/N as 2/N + 2/N + 12/N."""
    inner = opt.optimizer if isinstance(opt, ShardedOptimizer) else opt
    state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
    grads = (opt.gradient_tensors() if isinstance(opt, ShardedOptimizer)
             else [p.grad for p in net.parameters()])
    masters = [b.master for b in opt.buckets] if isinstance(opt, ShardedOptimizer) else []
    seen = set()
    out = {"parameters": memory.storage_bytes(net.parameters(), seen),
           "gradients": memory.storage_bytes(grads, seen),
           "optimizer_state": memory.storage_bytes(masters + [t for t in state if t.dim() > 0], seen)}
    out["total"] = sum(out.values())
    out["step_counters"] = memory.storage_bytes([t for t in state if t.dim() == 0], seen)
    return out


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           str, bytes, int, float, torch.dtype, torch.device)


def reachable_bytes(*roots):
    """Bytes of every distinct storage reachable from ``roots`` (a tensor's ``.grad`` included)
    through attributes, dicts, lists, tuples and sets, not through functions, modules or classes:
    `held_bytes`'s cross-check. It sees a buffer `held_bytes` does not list (a gathered weight never
    freed, a copy cached in an attribute); a tensor held only in a hook's closure it does not."""
    seen, todo, tensors = set(), list(roots), []
    while todo:
        obj = todo.pop()
        if obj is None or isinstance(obj, _OPAQUE) or id(obj) in seen:
            continue
        seen.add(id(obj))
        tensors += [obj, obj.grad] if torch.is_tensor(obj) else []
        if isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif hasattr(obj, "__dict__"):
            todo += list(vars(obj).values())
    return memory.storage_bytes(tensors)
