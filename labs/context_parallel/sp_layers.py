"""Chapter 6: the Megatron sequence-parallel layers, applied to chapter 4's tensor-parallel block.

Korthikanti et al. 2022 (arXiv 2205.05198, §4.2.2). Sequence parallelism splits the regions tensor
parallelism leaves replicated (LayerNorms, dropouts, residual adds) along the sequence, each of t
ranks holding s/t tokens, and gives chapter 4's f and g new collectives (the book's f_sp and g_sp; the
paper's g and g-bar, whose names the op labels here keep): f_sp is an all-gather along the sequence
in forward and a reduce-scatter in backward (before the column-parallel layer), g_sp a
reduce-scatter in forward and an all-gather in backward (after the row-parallel layer). The
column-parallel layer keeps only its s/t-token input shard for backward and gathers it again there
(Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication; ``regather=False`` keeps the
gathered input instead). `parallelize_block` applies all of it to one `labs.model.Block` from
outside; `sync_grads` all-reduces the LayerNorm and bias gradients that saw only this rank's
tokens. The lab that checks it is `labs.context_parallel.sequence_parallel`.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labs import model as tiny
from labs.measure import comm
from labs.tensor_parallel import megatron


def gather_seq(x, group, op):
    """(B, s/t, H) -> (B, s, H): every rank's tokens, in rank order, through `comm.all_gather`."""
    t = dist.get_world_size(group)
    shard = x.transpose(0, 1).contiguous()                    # (s/t, B, H): sequence first, as Megatron's sbh
    full = shard.new_empty((t * shard.size(0),) + tuple(shard.shape[1:]))
    megatron.record(op, shard)   # the shard each rank sends
    comm.all_gather(full, shard, group=group)
    return full.transpose(0, 1)                               # (B, s, H)


def scatter_seq(x, group, op):
    """(B, s, H) partial sums -> (B, s/t, H): summed over ranks, this rank's tokens, `comm.reduce_scatter`."""
    t = dist.get_world_size(group)
    full = x.transpose(0, 1).contiguous()                     # (s, B, H)
    if full.size(0) % t:
        raise ValueError(f"sequence length {full.size(0)} is not divisible by tp = {t}; choose s "
                         "divisible by tp.")
    out = full.new_empty((full.size(0) // t,) + tuple(full.shape[1:]))
    megatron.record(op, full)    # the full input
    comm.reduce_scatter(out, full, group=group)
    return out.transpose(0, 1)                                # (B, s/t, H)


class _G(torch.autograd.Function):
    """g: all-gather along the sequence forward, reduce-scatter of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_seq(x, group, "g forward all-gather")

    @staticmethod
    def backward(ctx, grad):
        return scatter_seq(grad, ctx.group, "g backward reduce-scatter"), None


class _GBar(torch.autograd.Function):
    """g-bar: reduce-scatter of the partial outputs forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return scatter_seq(x, group, "g-bar forward reduce-scatter")

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group, "g-bar backward all-gather"), None


class _GatherLinear(torch.autograd.Function):
    """g fused with the column-parallel matmul Y_i = X A_i: saves the s/t-token shard of X, not X,
    and all-gathers it again in backward for dL/dA_i = dY_i^T X."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):                 # x (B, s/t, H), weight (out/t, H)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(gather_seq(x, group, "g forward all-gather"), weight, bias)   # (B, s, out/t)

    @staticmethod
    def backward(ctx, grad):                                  # grad (B, s, out/t)
        x, weight = ctx.saved_tensors
        grad_x = scatter_seq(grad @ weight, ctx.group, "g backward reduce-scatter")
        full = gather_seq(x, ctx.group, "backward re-gather of the input")           # (B, s, H)
        grad_w = grad.flatten(0, 1).t() @ full.flatten(0, 1)
        grad_b = grad.sum((0, 1)) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class ColumnParallelLinear(megatron.ColumnParallelLinear):
    """Chapter 4's column-parallel layer behind g: input (B, s/t, H), output (B, s, out/t)."""

    regather = True

    def forward(self, x):
        if self.regather:
            return _GatherLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(_G.apply(x, self.group), self.weight, self.bias)  # keeps the gathered X


class RowParallelLinear(megatron.RowParallelLinear):
    """Chapter 4's row-parallel layer before g-bar: input (B, s, in/t), output (B, s/t, H); the bias
    is added to this rank's tokens only, so its gradient is partial (see `sync_grads`)."""

    def forward(self, x):
        z = _GBar.apply(F.linear(x, self.weight), self.group)
        return z + self.bias if self.bias is not None else z


def parallelize_block(block, group=None, regather=True):
    """Turn one `labs.model.Block` into its TP+SP version in place: the block then takes and returns
    this rank's s/t tokens, (B, s/t, H). Same weight slices as `megatron.parallelize_*`."""
    t, rank = dist.get_world_size(group), dist.get_rank(group)
    attn, mlp, h = block.attn, block.mlp, block.attn.proj.in_features
    megatron.check_degree(tiny.GPTConfig(hidden=h, n_head=attn.n_head), t)
    qkv = megatron.qkv_rows(h, attn.n_head, t, rank)
    attn.qkv, attn.proj = (ColumnParallelLinear(attn.qkv, group, qkv),
                           RowParallelLinear(attn.proj, group, qkv[:h // t]))
    rows = megatron.shard_rows(mlp.fc.out_features, t, rank)
    mlp.fc, mlp.proj = ColumnParallelLinear(mlp.fc, group, rows), RowParallelLinear(mlp.proj, group, rows)
    attn.n_head //= t
    for layer in (attn.qkv, mlp.fc):
        layer.regather = regather
    return block


def sequence_parallel_params(block):
    """Parameters that saw only this rank's tokens: the LayerNorms and the row-parallel biases."""
    mods = (block.ln1, block.ln2, block.attn.proj, block.mlp.proj)
    return [p for m in mods for n, p in m.named_parameters()
            if n != "weight" or isinstance(m, torch.nn.LayerNorm)]


def sync_grads(block, group=None):
    """All-reduce the partial gradients of `sequence_parallel_params` (Megatron does this for the
    LayerNorm weights under sequence parallelism); logged as "parameter-gradient all-reduce"."""
    for p in sequence_parallel_params(block):
        megatron.logged_all_reduce(p.grad, group, "parameter-gradient all-reduce")


def _block(cfg, dev, dropout=0.0):
    torch.manual_seed(0)
    return tiny.Block(tiny.GPTConfig(**{**cfg.__dict__, "dropout": dropout})).to(dev)


def _tokens(s, t, rank):
    return slice(rank * s // t, (rank + 1) * s // t)
