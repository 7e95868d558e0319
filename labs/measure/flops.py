"""FLOP counting, by `torch.utils.flop_counter.FlopCounterMode` (FLOPs are counted, not assumed).

`counting()` is a FlopCounterMode that also counts the CPU's SDPA kernel, for which torch has no
formula (it would count 0 FLOPs), with the same formulas as the CUDA kernels, GQA included, on any
torch >= 2.11; `forward_backward(run)` counts a forward and its backward apart, in total and by op.
Chapter 1 compares these counts with its FLOPs-per-token formula (`labs.memory_budget.compute`);
chapter 9 counts what recomputation adds.
"""
from contextlib import contextmanager

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count


def _heads_as_query(q, kv):
    """A key/value shape with the query's heads: under GQA the kernel broadcasts each KV head over
    its group, so the matmuls are those of full multi-head attention (torch >= 2.12 counts GQA so;
    torch 2.11's formulas refuse unequal heads)."""
    return torch.Size([kv[0], q[1], *kv[2:]])


def _sdpa_mapping(cpu_sdpa):
    """SDPA FLOP formulas for every attention kernel, GQA included, on any torch >= 2.11.

    FlopCounterMode has formulas for the CUDA kernels but none for the CPU flash kernel, which it
    would count as 0 FLOPs. The same formulas (full s x s: 2 matmuls forward; backward 4 matmuls
    plus 1 to recompute the scores, which the CUDA formula counts too) are mapped onto it."""
    aten = torch.ops.aten
    fwd = lambda q, k, v, *a, out_shape=None, **kw: sdpa_flop_count(  # noqa: E731
        q, _heads_as_query(q, k), _heads_as_query(q, v))
    bwd = lambda g, q, k, v, *a, out_shape=None, **kw: sdpa_backward_flop_count(  # noqa: E731
        g, q, _heads_as_query(q, k), _heads_as_query(q, v))
    kernels = ["_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_cudnn_attention"]
    if cpu_sdpa:
        kernels.append("_scaled_dot_product_flash_attention_for_cpu")
    mapping = {}
    for name in kernels:
        mapping[getattr(aten, name)] = fwd
        mapping[getattr(aten, name + "_backward")] = bwd
    return mapping


@contextmanager
def counting(cpu_sdpa=True):
    """A FlopCounterMode that also counts the CPU SDPA kernel (unless cpu_sdpa=False)."""
    with FlopCounterMode(display=False, custom_mapping=_sdpa_mapping(cpu_sdpa)) as mode:
        yield mode


def _by_op(mode):
    return {str(op).split(".")[-1]: n for op, n in mode.get_flop_counts().get("Global", {}).items()}


def forward_backward(run, cpu_sdpa=True):
    """FLOPs of ``run()`` (forward) and of ``.backward()`` on its result, in total and by op."""
    with counting(cpu_sdpa) as f:
        out = run()
    with counting(cpu_sdpa) as b:
        out.backward()
    return {"forward": f.get_total_flops(), "backward": b.get_total_flops(),
            "forward_by_op": _by_op(f), "backward_by_op": _by_op(b)}
