"""Chapter 4: tensor parallelism, the Megatron-LM split of the MLP and attention: the layers.

Shoeybi et al. 2019 (arXiv 1909.08053), for Z = GeLU(X A) B on tp ranks:
- A = [A_1, ..., A_p] split by columns: rank i computes Y_i = GeLU(X A_i) with no communication,
  because GeLU acts on each column alone;
- B = [B_1; ...; B_p] split by rows: rank i computes Y_i B_i, a partial sum of Z, and one
  all-reduce adds the partial sums.
Two conjugate operators carry the communication: f is the identity in forward and an all-reduce
in backward (it sits before the column-parallel layer: every rank's input gradient is partial);
g is an all-reduce in forward and the identity in backward (after the row-parallel layer). One
all-reduce per block in forward, one in backward, each of b*s*h activation elements. Attention
splits the same way: heads by column (the fused qkv keeps its q, k and v blocks per head), the
output projection by rows. `apply_tensor_parallel` applies the split to the tiny GPT from outside
(the model has no ``if tp:``). Every all-reduce's payload and shape are recorded from the tensor f
or g hands to the collective (`payloads`). The lab sets b, s and h, so the size b*s*h is known in
advance; what the record shows is which tensor travels: the activation, not a weight or the hidden.
The lab that proves all of it is `labs.tensor_parallel.blocks`.
"""
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labs.measure import comm

_logs = []  # the payload logs currently recording, innermost last


@contextlib.contextmanager
def payloads():
    """Record every all-reduce f and g make inside the block: the operator and the bytes of the
    tensor handed to the collective (numel x element size), read from that tensor, not assumed."""
    log = []
    _logs.append(log)
    try:
        yield log
    finally:
        _logs.remove(log)


def record(op, x):
    """Record one collective in every open `payloads()` log: the bytes of the tensor handed to it,
    read from the tensor."""
    for log in _logs:
        log.append({"op": op, "bytes": x.numel() * x.element_size(), "numel": x.numel(),
                    "element_size": x.element_size(), "shape": tuple(x.shape)})


def logged_all_reduce(x, group, op):
    """``comm.all_reduce`` of ``x`` over ``group``, recorded under ``op`` in every open log."""
    record(op, x)
    comm.all_reduce(x, group=group)


class _F(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        logged_all_reduce(grad, ctx.group, "f backward")
        return grad, None


class _G(torch.autograd.Function):
    """g: all-reduce of the partial outputs forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        logged_all_reduce(x, group, "g forward")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def check_degree(cfg, tp):
    """Refuse a tp that does not divide the heads and the MLP width, before any process starts."""
    _split(cfg.n_head, tp, "the number of heads")
    _split(4 * cfg.hidden, tp, "the MLP width 4h")


def _split(n, parts, what):
    if n % parts:
        raise ValueError(f"{what} = {n} is not divisible by tp = {parts}; choose a tp that divides it.")
    return n // parts


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i: this rank's output columns (rows of nn.Linear's weight), after f."""

    def __init__(self, full, group, rows):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rows].clone()) if full.bias is not None else None

    def forward(self, x):
        return F.linear(_F.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i: this rank's input rows, a partial product, summed by g; bias added once."""

    def __init__(self, full, group, cols):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(full.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x):
        z = _G.apply(F.linear(x, self.weight), self.group)
        return z + self.bias if self.bias is not None else z


def shard_rows(n, tp, rank):
    """This rank's slice of n output features."""
    size = _split(n, tp, "the output width")
    return torch.arange(rank * size, (rank + 1) * size)


def qkv_rows(hidden, n_head, tp, rank):
    """This rank's heads in the fused qkv weight: its slice of q, of k and of v."""
    heads = _split(n_head, tp, "the number of heads")
    d = hidden // n_head
    mine = torch.arange(rank * heads * d, (rank + 1) * heads * d)
    return torch.cat([mine, hidden + mine, 2 * hidden + mine])


def parallelize_mlp(mlp, group):
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = shard_rows(mlp.fc.out_features, tp, rank)
    mlp.fc = ColumnParallelLinear(mlp.fc, group, rows)
    mlp.proj = RowParallelLinear(mlp.proj, group, rows)
    return mlp


def parallelize_attention(attn, group):
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    hidden = attn.proj.in_features
    attn.qkv = ColumnParallelLinear(attn.qkv, group, qkv_rows(hidden, attn.n_head, tp, rank))
    attn.proj = RowParallelLinear(attn.proj, group, qkv_rows(hidden, attn.n_head, tp, rank)[:hidden // tp])
    attn.n_head //= tp
    return attn


def apply_tensor_parallel(model, group=None):
    """Turn every block of the tiny GPT into its tensor-parallel version, in place.

    Embeddings, LayerNorms and the head stay replicated: their inputs are identical on every rank
    (g has summed the partial outputs), so their gradients are too, with no communication.
    """
    for block in model.blocks:
        parallelize_attention(block.attn, group)
        parallelize_mlp(block.mlp, group)
    return model
