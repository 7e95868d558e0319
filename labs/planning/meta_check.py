"""Chapter 14: the planner's per-rank state bytes checked against PyTorch's own sharding, at full scale.

A rank of a layout is built on the ``meta`` device (shapes, no storage) inside a process group of the
"fake" backend at the layout's full world size (16,384 ranks for Llama 3 405B), so no process starts
and no byte is allocated. The rank's pipeline stage gets its real weights (chapter 1's `ModelShape`),
then PyTorch's pieces split them: `parallelize_module` (ColwiseParallel for q, k, v, w1, w3 and the
head, RowwiseParallel for wo, w2 and the embedding: Shoeybi et al. 2019, §3) over the tensor-parallel
dimension of the layout's `DeviceMesh` (`labs.groups.device_mesh`), and FSDP2's `fully_shard` over its
data-parallel dimension. What the rank
holds is then read from the DTensors (`to_local()`), and set beside the planner's count
(`memory.rank_params` split over dp, times FSDP2's bytes per element: chapter 3's fp32 shard 4,
fp32 gradient 4, Adam moments 8).

FSDP2 cuts each weight's dim 0 into chunks of ceil(rows / dp) (`torch.chunk`), so a rank's share
equals the planner's even split P_r / dp exactly when dp divides every tensor-parallel-local row
count; otherwise the last data-parallel ranks hold less (chapter 3's `fsdp2_local_rows` gives each
rank's rows, and `chunked_elements` adds them up from the planner's weights), and the planner's even
split is what the fullest rank holds minus its padding.
"""
import math

import torch
import torch.distributed as dist
from torch import nn

from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.pipeline.stage_balance import stage_layers
from labs.formulas.planning import memory, shapes
from labs.zero import distributed_optimizer

PIECES = distributed_optimizer.FSDP2_PIECES   # bytes per sharded element: params 4, grads 4, adam 8


class _Weights(nn.Module):
    """One layer (or the embedding, or the head) as its weights: a Linear per matrix, a vector per norm."""

    def __init__(self, weights):
        super().__init__()
        for w in weights:
            if len(w.shape) == 2 and w.split == "vocab" and w.name == "embedding":
                self.add_module(w.name, nn.Embedding(w.shape[0], w.shape[1]))
            elif len(w.shape) == 2:
                self.add_module(w.name, nn.Linear(w.shape[1], w.shape[0], bias=False))
            else:
                self.register_parameter(w.name, nn.Parameter(torch.empty(w.shape)))
        self.splits = {w.name: w.split for w in weights}


def _tp_plan(part):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    style = {"col": ColwiseParallel, "kv": ColwiseParallel, "row": RowwiseParallel}
    out = {}
    for name, split in part.splits.items():
        # the embedding by rows of V (RowwiseParallel on nn.Embedding), the head by columns
        if split == "vocab":
            out[name] = RowwiseParallel() if isinstance(getattr(part, name),
                                                        nn.Embedding) else ColwiseParallel()
        elif split in style and isinstance(getattr(part, name), nn.Linear):
            out[name] = style[split]()
    return out


def build_rank(model, plan, rank):
    """Rank ``rank`` of ``plan`` (dp x pp x tp, ranks ordered tp fastest) on meta, split by PyTorch;
    inside an initialised fake process group. Returns (module, stage, dp index, tp index)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    d = plan.dims
    mesh = device_mesh(d, "cpu")
    dp_i, stage, tp_i = (mesh.get_local_rank(a) for a in ("dp", "pp", "tp"))
    assert (dp_i, stage, tp_i) == tuple(d.coords(rank)[a] for a in ("dp", "pp", "tp")), "the mesh is the grid"
    layers = stage_layers(model.layers, d.pp, plan.v)[stage]
    with torch.device("meta"):
        parts = [_Weights(model.layer_weights(i)) for i in layers]
        if stage == 0:
            parts.insert(0, _Weights(model.embedding_weights()))
        if stage == d.pp - 1:
            parts.append(_Weights(model.head_weights()))
    root = nn.ModuleList(parts)
    for part in parts:
        if d.tp > 1:
            parallelize_module(part, mesh["tp"], _tp_plan(part))
        # one FSDP2 unit per layer, as chapter 3 (the list holds no weight)
        fully_shard(part, mesh=mesh["dp"])
    return root, stage, dp_i, tp_i


def measure_rank(model, plan, rank):
    """One rank, at the layout's full world size on the fake backend: the elements its DTensors hold,
    beside the planner's P_r / dp, and both as weights / gradients / optimizer bytes."""
    d = plan.dims
    if d.cp != 1 or d.ep != 1 or d.dp_replicate != 1 or plan.v != 1 or model.moe or model.mlp != "swiglu":
        raise ValueError("the meta-device check builds dense Llama-shaped dp x pp x tp layouts with v = 1 "
                         "only.")
    world = d.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of the {world:,} ranks of the layout.")
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        root, stage, dp_i, tp_i = build_rank(model, plan, rank)
        local = sum(p.to_local().numel() for p in root.parameters())      # what this rank stores
        whole = sum(math.prod(p.shape) for p in root.parameters())         # the DTensors' global shapes
    finally:
        dist.destroy_process_group()
    planned = memory.rank_params(model, plan, stage)["dense"] / d.dp   # the planner's P_r / dp
    state = memory.state_terms(model, d.tp, d.pp, d.ep, plan.v, stage, 3, d.dp, "mixed")
    return {"rank": rank, "world_size": world, "stage": stage, "dp_index": dp_i, "tp_index": tp_i,
            "local_elements": local, "global_elements": whole, "planner_elements": planned,
            "chunked_elements": chunked_elements(model, plan, stage, dp_i),
            "measured_bytes": {"weights": PIECES["params"] * local, "gradients": PIECES["grads"] * local,
                               "optimizer": PIECES["adam_moments"] * local},
            "planner_bytes": dict(zip(("weights", "gradients", "optimizer"), state))}


def chunked_elements(model, plan, stage, dp_index):
    """The elements FSDP2 gives data-parallel rank ``dp_index`` of stage ``stage``, from the planner's
    weights: each weight's tensor-parallel-local rows (`memory.local_numel`'s split) cut by chapter 3's
    `fsdp2_local_rows`."""
    total, d = 0, plan.dims
    for w in memory.stage_weights(model, d.pp, plan.v, stage):
        numel = memory.local_numel(w, d.tp, d.ep, model.kv_heads)
        rows = w.shape[0] if w.split == "row" else round(numel / math.prod(w.shape[1:]))
        total += distributed_optimizer.fsdp2_local_rows(rows, d.dp, dp_index) * numel // rows
    return total


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Build one rank of a dp x pp x tp layout of Llama 3 405B (or Llama 2 70B) on the meta "
                   "device with a fake process group, and compare its shards with the planner.", None)
    p.add_argument("--model", choices=("405B", "70B"), default="405B")
    for axis, default in (("dp", 128), ("pp", 16), ("tp", 8)):
        p.add_argument(f"--{axis}", type=cli.positive_int, default=default)
    p.add_argument("--rank", type=int, default=0)
    args = cli.parse(p, argv)
    plan = memory.Plan(ParallelDims(dp=args.dp, tp=args.tp, pp=args.pp), zero=3)
    if args.world_size not in (None, plan.dims.world_size):
        raise ValueError(f"--world-size {args.world_size} is not dp*pp*tp = {plan.dims.world_size}; "
                         "drop it or change the degrees.")
    model = shapes.LLAMA3_405B if args.model == "405B" else shapes.LLAMA2_70B
    r = measure_rank(model, plan, args.rank)
    cli.report(r, args,
               f"rank {r['rank']} of {r['world_size']:,} (stage {r['stage']}): {r['local_elements']:,} "
                        f"elements held, the planner counts {r['planner_elements']:,.0f}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
