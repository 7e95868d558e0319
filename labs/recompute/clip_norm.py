"""Chapter 9: gradient clipping across shards. The global norm under FSDP, TP and PP, each
parameter counted once, by hand and with the library, equal to one process.

Clipping scales every gradient by max_norm / ||g|| when the norm of the whole model's gradient,
one vector, exceeds max_norm. Sharded, no rank holds that vector: the norm is sqrt(sum over ranks of
the squares each rank holds), and a piece held by several ranks must be counted once.
- FSDP shards are disjoint: every rank's squares count.
- TP shards the column- and row-parallel weights (count every rank's), but the LayerNorms and the
  row-parallel biases are replicated over the tp ranks: count them on one. Megatron keeps a gradient
  for the norm only if ``param_is_not_tensor_parallel_duplicate`` (a TP-partitioned parameter, or
  TP rank 0) and ``param_is_not_shared``, then all-reduces the sum of squares over the
  model-parallel group (`megatron/core/optimizer/clip_grads.py`, `get_grad_norm_fp32`); with
  sequence parallelism the LayerNorm gradients are first summed over tp, being partial sums.
- PP stages hold different layers: sum their squares across the pipeline. torchtitan's
  ``clip_grad_norm_`` (`torchtitan/distributed/utils.py`) takes ``torch.nn.utils.get_total_norm`` of
  the DTensor gradients, whose placements count replicated dimensions once, calls
  ``full_tensor()``, and all-reduces norm^2 over the pp mesh (torchtitan issue #596: the library
  alone stops at a stage's own norm).

`rank_clip` runs a tiny two-block MLP stack on 4 ranks twice: FSDP2 over dp = 2 with TP (and
sequence parallelism) over tp = 2, then 2 pipeline stages with TP over tp = 2. Each time the norm is
computed the Megatron way by hand (`hand_norm`), with the library (`library_norm`), and the way
a plausible bug does it: every tp rank counting the replicated parameters (`hand_norm` with
``count_duplicates``), and, under PP, the library norm without the pipeline's reduction. The
gradients clipped with the library's norm are compared with one process clipping the same batch.

    python -m labs.recompute.clip_norm --json
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.launcher import launch

H, B, T, MAX_NORM = 16, 4, 8, 0.1   # hidden, batch, sequence; max_norm below the norm: clipping acts
# fp32 sums of a few hundred terms in another order on each side: ~1e-6 relative; the duplicate
# count and the stage's own norm miss by far more (the notebook prints how much)
BOUND = 1e-5


class Block(nn.Module):
    """LayerNorm, then a 4h MLP, with the residual: the LayerNorm and ``down``'s bias are replicated
    under TP, ``up`` and ``down.weight`` are sharded."""

    def __init__(self, h=H):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):                                       # (B, T, h)
        return x + self.down(F.gelu(self.up(self.norm(x))))


def stack(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(Block(), Block())


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)   # x, target


def reference(max_norm=MAX_NORM):
    """One process on the whole batch: the norm and the clipped gradients, by name."""
    net = stack()
    x, y = batch()
    F.mse_loss(net(x), y, reduction="sum").div(x.numel()).backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm).item()
    return norm, {n: p.grad.clone() for n, p in net.named_parameters()}


def tp_plan():
    """Chapter 6's sequence-parallel split: LayerNorm on the sequence, up column-, down row-parallel."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    return {"norm": SequenceParallel(use_local_output=True), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}


def _replicate_partial(g):
    """A DTensor gradient whose partial sums (sequence parallelism's LayerNorm) are added up."""
    from torch.distributed.tensor import Replicate
    if any(p.is_partial() for p in g.placements):
        g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
    return g


def hand_norm(params, tp_rank, count_duplicates=False):
    """Megatron's rule by hand: this rank's squares of every gradient it holds, except a gradient
    replicated over tp on a tp rank other than 0 (unless ``count_duplicates``: the bug), all-reduced
    over every rank (FSDP's shards, TP's shards and PP's stages are disjoint pieces)."""
    total = torch.zeros((), dtype=torch.float64, device=launch.device())
    for p in params:
        g = _replicate_partial(p.grad)
        tp_dim = g.device_mesh.mesh_dim_names.index("tp")
        if count_duplicates or tp_rank == 0 or not g.placements[tp_dim].is_replicate():
            total += g.to_local().double().pow(2).sum()
    dist.all_reduce(total)
    return total.sqrt().item()


def library_norm(params, pp_group=None):
    """The library's norm, after which the gradients are clipped by it. Without a pipeline,
    ``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients; with one, torchtitan's
    ``clip_grad_norm_``: ``get_total_norm``, ``full_tensor()``, norm^2 summed over the stages.
    Returns the norm and this stage's own (what the library alone would use under PP)."""
    if pp_group is None:
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return norm.item(), norm.item()
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    stage_norm = norm.item()
    norm = norm ** 2
    dist.all_reduce(norm, group=pp_group)
    norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
    return norm.item(), stage_norm


def _max_err(got, want):
    """Largest |full gradient - one process's| over the named parameters, relative to each one's max."""
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in got)


def fsdp_tp(rank, mesh):
    """FSDP2 over dp = 2 with TP and SP over tp = 2: each dp rank its half of the batch, each tp
    rank its half of the sequence."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    dev = launch.device()
    net = stack().to(dev)
    for block in net:
        parallelize_module(block, mesh["tp"], tp_plan())
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    x, y = (t.to(dev) for t in batch())
    rows, cols = slice(dp * B // 2, (dp + 1) * B // 2), slice(tp * T // 2, (tp + 1) * T // 2)
    # the whole batch's mean, as a sum over ranks; FSDP divides the reduced gradients by dp
    loss = F.mse_loss(net(x[rows, cols]), y[rows, cols], reduction="sum") * 2 / x.numel()
    loss.backward()
    params = list(net.parameters())
    out = {"hand": hand_norm(params, tp), "duplicates_counted": hand_norm(params, tp, count_duplicates=True)}
    out["library"], _ = library_norm(params)
    out["grads"] = {n: p.grad.full_tensor().cpu() for n, p in net.named_parameters()}
    return out


def pp_tp(rank, mesh):
    """2 pipeline stages (block 0, block 1) with TP and SP over tp = 2 inside each; the activation
    and its gradient cross between the ranks of the same tp rank."""
    from torch.distributed.tensor.parallel import parallelize_module
    stage, tp = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    peer = mesh["pp"].mesh[1 - stage].item()                     # the other stage, same tp rank
    dev = launch.device()
    block = parallelize_module(stack()[stage].to(dev), mesh["tp"], tp_plan())
    x, y = (t.to(dev) for t in batch())
    cols = slice(tp * T // 2, (tp + 1) * T // 2)
    if stage == 0:
        out = block(x[:, cols])                                   # (B, T/tp, h)
        dist.send(out.detach().contiguous(), peer)
        grad = torch.empty_like(out)
        dist.recv(grad, peer)
        out.backward(grad)
    else:
        h = torch.empty(B, T // 2, H, device=dev)
        dist.recv(h, peer)
        h.requires_grad_(True)
        F.mse_loss(block(h), y[:, cols], reduction="sum").div(x.numel()).backward()
        dist.send(h.grad.contiguous(), peer)
    params = list(block.parameters())
    res = {"hand": hand_norm(params, tp), "duplicates_counted": hand_norm(params, tp, count_duplicates=True)}
    res["library"], res["stage_only"] = library_norm(params, mesh["pp"].get_group())
    res["grads"] = {f"{stage}.{n}": p.grad.full_tensor().cpu() for n, p in block.named_parameters()}
    return res


def rank_clip(rank, world_size):
    if world_size != 4:
        raise ValueError(f"the clipping lab runs dp (or pp) = 2 by tp = 2: world size 4, not {world_size}.")
    norm, grads = reference()
    out = {"reference": norm}
    for name, run, dims in (("fsdp_tp", fsdp_tp, ParallelDims(dp=2, tp=2)),
                            ("pp_tp", pp_tp, ParallelDims(pp=2, tp=2))):
        r = run(rank, device_mesh(dims))
        r["max_grad_err"] = _max_err(r.pop("grads"), grads)
        out[name] = r
    return out


def run(timeout=240.0):
    """Both layouts on 4 ranks against one process: per layout the norms (hand, library, the two
    wrong ones) and the clipped gradients' largest relative error; rank 0's result (every rank
    computes the same global numbers)."""
    return launch.spawn(rank_clip, 4, timeout=timeout)[0]


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Gradient clipping across shards: the global norm under FSDP + TP and PP + TP, by "
                   "hand and with the library, against one process.", world_size_default=4)
    args = cli.parse(p, argv)
    if args.world_size not in (None, 4):
        raise ValueError(f"the clipping lab runs dp (or pp) = 2 by tp = 2: "
                         f"drop --world-size {args.world_size}.")
    r = run(timeout=args.timeout)
    lines = [f"one process: {r['reference']:.6f}"]
    for name in ("fsdp_tp", "pp_tp"):
        v = r[name]
        lines.append(f"{name}: hand {v['hand']:.6f}, library {v['library']:.6f}, replicated counted tp times "
                     f"{v['duplicates_counted']:.6f}; clipped gradients within {v['max_grad_err']:.1e}")
    cli.report(r, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
