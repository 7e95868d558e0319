"""Chapter 17: the same 3D layout with PyTorch's own pieces, and an audit of what they send per group.

One 3D ``DeviceMesh`` (dims dp, pp, tp: the layout's grid, tp fastest, built by `labs.groups.device_mesh`),
and on it, applied from outside to the plain tiny GPT's stage:
- tensor parallelism with ``parallelize_module`` (``ColwiseParallel`` on qkv and fc, ``RowwiseParallel``
  on the two output projections). ``ColwiseParallel`` hands rank r the r-th block of the fused
  qkv's rows, so the rows are first permuted to [q_r, k_r, v_r] per rank: Megatron's head split
  (`labs.tensor_parallel.megatron.qkv_rows`), and the model's ``chunk(3)`` finds its own q, k, v;
- FSDP2 (``fully_shard``) over dp, with ``reshard_after_forward=False``: the pipeline schedule then
  gathers the weights once per step and reduce-scatters the gradients once, after the last
  micro-batch, which is what ZeRO-1 sends (one reduce-scatter, one all-gather of the shards);
- ``torch.distributed.pipelining``: a ``PipelineStage`` per rank on the pp group, ``Schedule1F1B``.
`LibraryBytes` counts what that stack sends the way chapter 3 counts FSDP2's (`labs.zero.hsdp`): a
TorchDispatchMode sees every c10d op and functional collective, with its process group, so each
call's payload (the tensor it was called with) and ring formula bytes (`labs.formulas.costs`) land on
the group they ran on. `grad_shards` hands each rank's step-1 gradients, as FSDP2 leaves them reduced,
to the step-1 gradient check (`labs.threed.gradcheck`); ``scale_bugs`` reruns step 1 with a planted
bug ("fsdp_sum": FSDP2 reducing with SUM instead of the mean, `set_gradient_divide_factor(1.0)`).

    python -m labs.threed.torch3d --dp 2 --tp 2 --pp 2 --json
"""
import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from labs import model as tiny
from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.launcher import launch
from labs.formulas import costs
from labs.measure import comm
from labs.pipeline.executor import cross_entropy, split
from labs.threed import layout3d
from labs.tensor_parallel import megatron

# A pipeline send is filed by what it carries, told by its dtype (torch 2.13,
# torch/distributed/pipelining): the first step's warm-up vote, one int32 (stage.py,
# `_warmup_forward_vote`, called by schedules.py's `_warmup_p2p`; `_warmup_backward_result` sends it
# back), and each stage's output metadata by `dist.send_object_list` (stage.py `_send_meta`), two
# sends: the pickled object's size, one int64, then its bytes, uint8. Floats are activations and
# their gradients.
SEND_KINDS = {torch.int32: "send vote", torch.int64: "send meta size", torch.uint8: "send meta"}
SILENT = {"c10d.recv_.default", "_c10d_functional.wait_tensor.default",
          "_c10d_functional._wrap_tensor_autograd.default", "c10d.barrier.default"}


def _nbytes(t):
    return t.numel() * t.element_size()


class LibraryBytes(TorchDispatchMode):
    """Per group label and op: calls, payload (bytes of the tensors each call was given) and sent
    (ring formula bytes this rank sends: all-reduce 2(n-1)/n, all-gather (n-1) x its shard,
    reduce-scatter (n-1)/n of the input; a send, its payload, filed by kind: `SEND_KINDS`).
    ``labels``: {group name: label}."""

    def __init__(self, labels):
        super().__init__()
        self.labels = labels
        self.ops = defaultdict(lambda: {"calls": 0, "payload": 0, "sent": 0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if func.namespace not in ("c10d", "_c10d_functional") or name in SILENT:
            return func(*args, **kwargs)
        if name == "_c10d_functional.all_reduce.default":          # (tensor, op, group name): DTensor
            pg = torch._C._distributed_c10d._resolve_process_group(args[2])
            self._record("all_reduce", pg, _nbytes(args[0]), self._ring(args[0], pg))
        elif name == "c10d.allreduce_.default":                    # ([tensors], pg, ...)
            pg = dist.ProcessGroup.unbox(args[1])
            self._record("all_reduce", pg, _nbytes(args[0][0]), self._ring(args[0][0], pg))
        elif name == "c10d._allgather_base_.default":              # (output, input, pg): FSDP2
            pg = dist.ProcessGroup.unbox(args[2])
            n, shard = pg.size(), _nbytes(args[1])
            self._record("all_gather", pg, shard, costs.sent("all_gather", n * shard, n))
        elif name == "c10d._reduce_scatter_base_.default":         # (output, input, pg, op): FSDP2
            pg = dist.ProcessGroup.unbox(args[2])
            self._record("reduce_scatter", pg, _nbytes(args[1]),
                         costs.sent("reduce_scatter", _nbytes(args[1]), pg.size()))
        elif name == "c10d.send.default":                          # ([tensors], pg, dst, tag): pipelining
            pg, size = dist.ProcessGroup.unbox(args[1]), sum(_nbytes(t) for t in args[0])
            self._record(SEND_KINDS.get(args[0][0].dtype, "send"), pg, size, size)
        else:
            raise RuntimeError(f"LibraryBytes does not know {name}: teach it the op's payload.")
        return func(*args, **kwargs)

    @staticmethod
    def _ring(t, pg):
        return comm.ring_allreduce_elements(t.numel(), pg.size(), pg.rank()) * t.element_size()

    def _record(self, op, pg, payload, sent):
        e = self.ops[(self.labels.get(pg.group_name, pg.group_name), op)]
        e["calls"] += 1
        e["payload"] += payload
        e["sent"] += sent

    def by_group(self):
        out = defaultdict(int)
        for (group, _), e in self.ops.items():
            out[group] += e["sent"]
        return dict(out)

    def table(self):
        return {f"{g} {op}": dict(e) for (g, op), e in sorted(self.ops.items())}


def build_stage(cfg, mesh):
    """This rank's pipeline stage of the plain tiny GPT under parallelize_module and fully_shard."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    tp, pp = mesh["tp"].size(), mesh["pp"].size()
    net = tiny.build(cfg, seed=0)
    rows = torch.cat([megatron.qkv_rows(cfg.hidden, cfg.n_head, tp, r) for r in range(tp)])
    with torch.no_grad():
        # [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: Colwise's block r is rank r's heads
        for block in net.blocks:
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[rows])
            block.attn.qkv.bias.copy_(block.attn.qkv.bias[rows])
    piece = split(net, pp)[mesh.get_local_rank("pp")]
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    for block in piece.blocks:
        parallelize_module(block, mesh["tp"], plan)
        block.attn.n_head //= tp           # the model reads its head count; now a/tp heads per rank
    fully_shard(piece, mesh=mesh["dp"], reshard_after_forward=False)
    return piece


@torch.no_grad()
def grad_shards(piece, dp_rank, dp):
    """This rank's gradients as FSDP2 leaves them after backward (reduced over dp), in
    `labs.threed.gradcheck.shards`'s form: [(local name, offset in the flat elements of the rank's
    tensor-parallel block, values)]. FSDP2 shards each parameter's TP block (the whole parameter where
    tp replicates it) along dim 0 in chunks of ceil(rows / dp): dp rank d holds rows from d * chunk."""
    out = []
    for name, p in piece.named_parameters():
        g, shape = p.grad, list(p.shape)
        for axis, place in zip(g.device_mesh.mesh_dim_names, g.placements):
            if axis == "tp" and place.is_shard():
                shape[place.dim] //= g.device_mesh.size(g.device_mesh.mesh_dim_names.index("tp"))
        local, chunk, row = g.to_local(), -(-shape[0] // dp), math.prod(shape[1:])
        rows = max(0, min(chunk, shape[0] - dp_rank * chunk))
        assert list(local.shape) == [rows, *shape[1:]], (name, local.shape, shape)
        out.append((name, dp_rank * chunk * row, local.reshape(-1).clone()))
    return out


LIBRARY_BUGS = ("fsdp_sum",)   # the planted bugs `_step1_with_bug` knows


def _step1_with_bug(cfg, mesh, dev, bug, x, y, m):
    """Step 1 again on a fresh stage with one planted bug; its gradients (`grad_shards`)."""
    import torch.distributed.pipelining as pipelining
    piece = build_stage(cfg, mesh)
    # reduce-scatter with SUM and divide by 1: the gradient dp times the mean (forcing SUM, as gloo has
    # no PREMUL_SUM; torch 2.13, fsdp/_fully_shard/_fsdp_collectives.py, _get_gradient_divide_factors)
    piece.set_gradient_divide_factor(1.0)
    piece.set_force_sum_reduction_for_comms(True)
    pp = mesh["pp"].size()
    stage = pipelining.PipelineStage(piece, mesh.get_local_rank("pp"), pp, dev, group=mesh.get_group("pp"))
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=m, loss_fn=cross_entropy)
    if stage.is_first:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=[])
    return grad_shards(piece, mesh.get_local_rank("dp"), mesh["dp"].size())


def train(rank, world_size, dims, steps=layout3d.STEPS, lr=layout3d.LR, micro_batch=layout3d.MICRO_BATCH,
          num_microbatches=layout3d.MICROBATCHES, scale_bugs=()):
    """The library-built 3D run: per step the loss of each micro-batch (last stage) and the bytes per
    group and op counted by `LibraryBytes`; also checks that the mesh's groups are the grid's. Step 1's
    reduced gradients ("grad1", `grad_shards`), and for each of ``scale_bugs`` those of step 1 rerun
    with that bug planted ("bugs")."""
    import torch.distributed.pipelining as pipelining
    dp, pp = dims.dp, dims.pp
    dev, cfg, m = launch.device(), layout3d.config(), num_microbatches
    mesh = device_mesh(dims, dev.type)
    for axis in ("dp", "pp", "tp"):
        mine = dist.get_process_group_ranks(mesh.get_group(axis))
        assert mine in dims.groups(axis), f"the mesh's {axis} group {mine} is not the grid's"
    labels = {mesh.get_group(a).group_name: a for a in ("dp", "pp", "tp")}
    piece = build_stage(cfg, mesh)
    stage = pipelining.PipelineStage(piece, mesh.get_local_rank("pp"), pp, dev, group=mesh.get_group("pp"))
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=m, loss_fn=cross_entropy)
    opt = torch.optim.Adam(piece.parameters(), lr=lr)
    d = mesh.get_local_rank("dp")
    out = {"rank": rank, "last": stage.is_last, "tp_rank": mesh.get_local_rank("tp"), "losses": [],
           "sent": [], "ops": [], "stage": mesh.get_local_rank("pp"), "bugs": {},
           "coords": {a: mesh.get_local_rank(a) if a != "cp" else 0 for a in ("dp", "pp", "tp", "cp")}}
    for step in range(steps):
        batches = layout3d.step_batches(cfg, step, dp, m, micro_batch)[d * m:(d + 1) * m]
        x, y = (torch.cat([b[i] for b in batches]).to(dev) for i in (0, 1))
        losses, mode = [], LibraryBytes(labels)
        with mode:
            if stage.is_first:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
        if step == 0:           # after backward and FSDP2's reduce-scatter, before the update
            out["grad1"], first = grad_shards(piece, d, dp), (x, y)
        opt.step()
        opt.zero_grad()
        out["losses"].append([loss.item() for loss in losses])
        out["sent"].append(mode.by_group())
        out["ops"].append(mode.table())
    out["bugs"] = {bug: _step1_with_bug(cfg, mesh, dev, bug, *first, m) for bug in scale_bugs}
    return out


def summarize(results):
    """The loss of each step (mean over every replica's micro-batches) and each rank's bytes per step."""
    last = [r for r in results if r["last"] and r["tp_rank"] == 0]
    losses = [sum(sum(r["losses"][t]) for r in last) / sum(len(r["losses"][t]) for r in last)
              for t in range(len(last[0]["losses"]))]
    return {"losses": losses, "sent": [r["sent"] for r in results], "ops": [r["ops"] for r in results],
            "stages": [r["stage"] for r in results], "coords": [r["coords"] for r in results],
            "grad1": [r["grad1"] for r in results],
            "bugs": {b: [r["bugs"][b] for r in results] for b in results[0]["bugs"]}}


def check(dims, micro_batch=layout3d.MICRO_BATCH, num_microbatches=layout3d.MICROBATCHES):
    """The layout layout3d accepts, without context parallelism: PyTorch's public
    ``context_parallel`` takes over SDPA's ops (torch 2.13,
    distributed/tensor/experimental/_context_parallel/_attention.py), and the book's model writes its
    attention out (q k^T, softmax, v) so the rounding bound can hook each piece: there is no SDPA call
    for it to take over, on any device."""
    if dims.cp != 1:
        raise ValueError("PyTorch's public context_parallel takes over scaled_dot_product_attention, which "
                         "the book's model does not call (its attention is written out); the library-built "
                         "run takes --dp, --tp and --pp only (use train3d for cp).")
    if dims.pp < 2:     # one stage is first and last: torch's schedule then needs the targets too
        raise ValueError(f"the library-built run is a pipeline (Schedule1F1B over stages): give --pp 2 or "
                         f"more, not {dims.pp} (use train3d for a layout without one).")
    return layout3d.check(layout3d.config(), dims, micro_batch=micro_batch, num_microbatches=num_microbatches)


def run(dims, steps=layout3d.STEPS, lr=layout3d.LR, micro_batch=layout3d.MICRO_BATCH,
        num_microbatches=layout3d.MICROBATCHES, timeout=300, scale_bugs=()):
    check(dims, micro_batch, num_microbatches)
    unknown = [b for b in scale_bugs if b not in LIBRARY_BUGS]
    if unknown:   # said before any process starts, not after training
        raise ValueError(f"unknown library bug {unknown[0]!r}: planted are {', '.join(LIBRARY_BUGS)}.")
    results = launch.spawn(train, dims.world_size, dims, steps, lr, micro_batch, num_microbatches,
                           tuple(scale_bugs), timeout=timeout)
    return summarize(results)


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("The 3D layout with DeviceMesh, parallelize_module, fully_shard and pipelining's 1F1B: "
                   "losses beside one process's, bytes per group beside the prediction.",
                   world_size_default=None)
    layout3d.add_options(p, cli)
    args = cli.parse(p, argv)
    d = ParallelDims(**{a: getattr(args, a) for a in ("dp", "tp", "pp", "cp")})
    check(d, args.micro_batch, args.microbatches)
    if args.world_size not in (None, d.world_size):
        raise ValueError(f"--world-size {args.world_size} is not dp*tp*pp = {d.world_size}; drop "
                         "--world-size.")
    results = launch.launch(train, d.world_size, d, args.steps, layout3d.LR, args.micro_batch,
                            args.microbatches,
                            timeout=args.timeout)
    if results is None:
        return
    r, cfg = summarize(results), layout3d.config()
    ref = layout3d.reference(cfg, d.dp, args.microbatches, args.micro_batch, args.steps,
                             layout3d.LR)["losses"]
    predicted = [layout3d.predict_bytes_per_group(cfg, d, args.micro_batch, args.microbatches, cfg.seq_len, s)
                 for s in r["stages"]]
    result = {"degrees": d.degrees(), "losses": r["losses"], "reference_losses": ref,
              "sent_last_step_per_rank": [s[-1] for s in r["sent"]], "predicted_per_rank": predicted}
    cli.report(result, args, f"library 3D dp={d.dp} tp={d.tp} pp={d.pp}: losses "
               f"{[round(x, 5) for x in r['losses']]}, one process {[round(x, 5) for x in ref]}; rank 0 sent "
               f"{r['sent'][0][-1]} bytes per group in the last step, predicted {predicted[0]}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
