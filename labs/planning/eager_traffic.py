"""Chapter 14: the bytes an eager stack's elementwise ops move, counted.

An eager stack (no torch.compile, no fused kernels) runs each non-matmul op of a layer on its own,
reading its inputs and writing its outputs. `count` adds them up on the tiny Llama block with a
dispatch mode, forward and backward, beside the bytes the block saves for backward. The planner
(`labs.formulas.planning.kernels`) runs without torch, so it carries this count as a record,
`kernels.EAGER_TRAFFIC`; tests/test_planner_model.py counts again and compares.
"""
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labs import model as tiny
from labs.measure import memory as measured


MATMULS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward")


VIEWS = ("view", "_unsafe_view", "t", "transpose", "expand", "permute", "detach", "alias", "slice", "select",
         "unsqueeze", "squeeze", "as_strided", "split", "split_with_sizes", "unbind", "_reshape_alias")


class _Traffic(TorchDispatchMode):
    """Adds up the bytes of the inputs and outputs of every op that is neither a matmul nor a view."""

    def __enter__(self):
        self.bytes = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in MATMULS and name not in VIEWS:
            self.bytes += _nbytes(args) + _nbytes(kwargs or {}) + _nbytes(out)
        return out


def _nbytes(x):
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    if isinstance(x, dict):
        return sum(_nbytes(y) for y in x.values())
    return 0


@functools.lru_cache(maxsize=None)
def count(b=2, s=64):
    """(bytes the eager ops of one Llama block (RMSNorm, RoPE, SwiGLU, residuals; SDPA and the matmuls
    left out) read and write in forward and backward, bytes the block saves for backward): counted, on a
    block with Llama 3 8B's proportions (4 query heads per KV head, f = 3.5 h)."""
    cfg = tiny.LlamaConfig(hidden=256, n_head=8, n_kv_head=2, ffn=896, seq_len=s)
    torch.manual_seed(0)
    block = tiny.LlamaBlock(cfg).to(torch.bfloat16)
    x = torch.randn(b, s, cfg.hidden, dtype=torch.bfloat16, requires_grad=True)
    with measured.saved_for_backward(block) as saved:
        block(x)
    with _Traffic() as traffic:
        y = block(x)
        y.backward(torch.ones_like(y))
    return traffic.bytes, saved.bytes
