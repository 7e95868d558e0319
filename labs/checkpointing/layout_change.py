"""Chapter 12: a checkpoint saved under one parallel layout (dp x tp) and loaded under another.

A change of tensor-parallel degree changes which *rows or columns* of a weight a rank holds, not
only which flat range: Megatron's column-parallel layers keep rows of W (for the fused qkv, the
rows of this rank's heads in each of q, k and v), its row-parallel layers keep columns
(`labs.tensor_parallel.megatron`). Each rank's piece is then a set of global flat indices, many
runs of them. The hand format stores those runs (`sharded_checkpoint.Shard.index`), and loading
is again the copy of every overlap, whatever layout wrote the runs and whatever layout reads them.

Two ways, each trained on the tiny GPT from the same seed:
- ``"hand"``: the hand tensor parallelism of chapter 4 on ``tp`` ranks, inside the hand FSDP of
  chapter 3 over the ``dp`` ranks that hold the same TP slice; the hand format.
- ``"dcp"``: DTensor tensor parallelism (``parallelize_module``, Colwise on the MLP's first layer,
  Rowwise on its second; the fused qkv stays whole, as Colwise would split its q, k and v blocks
  wrongly) on a (dp, tp) DeviceMesh, FSDP2 over dp; DCP, which reshards DTensors saved under one
  mesh into another.

The run saved under (dp, tp) is loaded under (dp', tp') and trains on; the weights must come back
bit for bit and the losses stay within `resharding.LOSS_TOL` of the uninterrupted run (another
layout sums its partial products in another order). A change of pipeline degree is trained in
`labs.checkpointing.pipeline_change`: a stage holds whole layers, so it changes which keys a rank
reads, provided each stage keys its layers by their global names.
"""
import os
import tempfile

import torch
import torch.distributed as dist

from labs import groups, model as tiny
from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.launcher import launch
from labs.tensor_parallel import megatron
from labs.zero import fsdp
from labs.checkpointing import resharding as ck, sharded_checkpoint as sc, training
from labs.checkpointing.stateful_loader import StatefulLoader


def global_index(cfg, tp, tp_rank):
    """{parameter name: (global shape, the global flat index of every element this TP rank holds)},
    from the same row choices `megatron.apply_tensor_parallel` makes."""
    # shapes only: training's RNG stays untouched
    with torch.random.fork_rng():
        h, net = cfg.hidden, tiny.GPT(cfg)
    qkv = megatron.qkv_rows(h, cfg.n_head, tp, tp_rank)             # this rank's heads in q, k, v
    fc = megatron.shard_rows(4 * h, tp, tp_rank)
    rows = {"attn.qkv": qkv, "mlp.fc": fc}                          # column-parallel: rows of W
    cols = {"attn.proj": qkv[:h // tp], "mlp.proj": fc}             # row-parallel: columns of W
    out = {}
    for name, p in net.named_parameters():
        layer, kind = name.rsplit(".", 1)[0].split(".", 2)[-1], name.rsplit(".", 1)[1]
        flat = torch.arange(p.numel())
        if tp > 1 and layer in rows:
            r = rows[layer]
            flat = (r[:, None] * h + torch.arange(h)).reshape(-1) if kind == "weight" else r
        elif tp > 1 and layer in cols and kind == "weight":
            c = cols[layer]
            flat = (torch.arange(p.shape[0])[:, None] * p.shape[1] + c).reshape(-1)
        out[name] = (tuple(p.shape), flat)
    return out


def tp_state(index, tp_rank, saving):
    """A `resharding.hand_state` for HandFSDP over a tensor-parallel model: each FSDP piece of a
    TP-local parameter, as the global flat indices it covers. Replicated parameters (LayerNorms,
    embeddings, head, row-parallel biases) are written by tensor-parallel rank 0 only
    (``saving``), and read by every rank."""
    def state(hand, opt):
        model, optim = {}, {}
        for u in hand.units:
            for places, piece, local in zip(u.where, u.pieces, u.shapes):
                name = fsdp.param_name(hand.model, places[0])
                shape, idx = index[name]
                if saving and tp_rank and idx.numel() == torch.Size(shape).numel():
                    continue                                       # replicated: one copy suffices
                keep = max(0, min(piece.numel(), local.numel() - piece.offset))
                at = idx[piece.offset:piece.offset + keep]
                model[name] = sc.Shard(piece.data[:keep], 0, shape, at)
                st = opt.state[piece]
                optim[name] = {k: sc.Shard(st[k][:keep], 0, shape, at) for k in ("exp_avg", "exp_avg_sq")}
                optim[name]["step"] = st["step"]
        return {"model": model, "optim": optim}
    return state


def build(kind, rank, world_size, tp, cfg, dev):
    """The tiny GPT under (dp, tp) = (world_size / tp, tp): (net, hand, opt, sched, loader, grid,
    (the hand format's state to save, and to load into))."""
    lay = ParallelDims.build(world_size, tp=tp)
    grid = groups.Groups(lay)
    dp_rank, net = grid.coords["dp"], tiny.build(cfg, seed=0, device=dev)
    hand, state_fns = None, (ck.hand_state, ck.hand_state)
    if kind == "hand":
        if tp > 1:
            megatron.apply_tensor_parallel(net, grid.tp)
            index = global_index(cfg, tp, grid.coords["tp"])
            state_fns = tuple(tp_state(index, grid.coords["tp"], saving) for saving in (True, False))
        hand = fsdp.HandFSDP(net, list(net.blocks), group=grid.dp)
    else:
        mesh = device_mesh(lay, dev.type)
        if tp > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            for block in net.blocks:
                parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(),
                                                           "proj": RowwiseParallel()})
        fsdp.fully_shard_units(net, list(net.blocks), mesh["dp"])
    opt, sched = training.optimizer(net)
    loader = StatefulLoader(training.NUM_SAMPLES, training.GLOBAL_BATCH, dp_rank, lay.dp)
    return net, hand, opt, sched, loader, grid, state_fns


def _full(net, hand, grid, cfg, tp):
    """{name: full fp32 weights}, gathered over dp and tp (for the checks only)."""
    if hand is None:
        return {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}
    local = hand.full_parameters()                                  # TP-local, gathered over dp
    if tp == 1:
        return local
    index = global_index(cfg, tp, grid.coords["tp"])
    parts = [None] * tp
    dist.all_gather_object(parts, {n: (index[n][1], t.reshape(-1)) for n, t in local.items()}, group=grid.tp)
    out = {n: torch.empty(torch.Size(shape).numel()) for n, (shape, _) in index.items()}
    for part in parts:
        for n, (idx, values) in part.items():
            out[n][idx] = values
    return {n: out[n].view(index[n][0]) for n in out}


def run(rank, world_size, kind, root, steps, tp, save_at=None, load_at=None, cfg=None):
    """Train under (world_size / tp, tp); save after ``save_at`` steps or start from ``load_at``.
    Returns losses, the saved or loaded full weights, and the global batches of each step."""
    cfg, dev = cfg or tiny.GPTConfig(), launch.device()
    net, hand, opt, sched, loader, grid, (save_fn, load_fn) = build(kind, rank, world_size, tp, cfg, dev)
    dp_rank, dp = grid.coords["dp"], grid.dims.dp
    out, first = {"losses": [], "batches": []}, 0
    if load_at is not None:
        ck._load(kind, net, hand, opt, sched, loader, os.path.join(root, f"step-{load_at}"), state_fn=load_fn)
        out["loaded"], first = _full(net, hand, grid, cfg, tp), load_at
    for step in range(first, steps):
        ids = loader.next()
        loss = net(*training.masked_batch(cfg, ids, dp_rank, dp, dev))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)            # every TP rank of a dp group holds the same loss
        seen = [None] * world_size
        dist.all_gather_object(seen, (grid.coords["tp"], ids))
        out["losses"].append(total.item() / world_size)
        out["batches"].append([i for t, s in seen if t == 0 for i in s])
        if save_at is not None and step + 1 == save_at:
            ck._save(kind, net, hand, opt, sched, loader, os.path.join(root, f"step-{save_at}"),
                     state_fn=save_fn)
            out["saved"] = _full(net, hand, grid, cfg, tp)
    return out


@launch.on_cpu(sc.ON_CPU)
def run_both(rank, world_size, root, steps, tp, save_at=None, load_at=None, cfg=None):
    return {kind: run(rank, world_size, kind, os.path.join(root, kind), steps, tp, save_at, load_at, cfg)
            for kind in ("hand", "dcp")}


def change_layout(src=(2, 2), dsts=((4, 1), (1, 2)), steps=5, save_at=3, timeout=180.0, cfg=None):
    """Train under ``src`` = (dp, tp), save after ``save_at`` steps; load under each (dp', tp') of
    ``dsts`` and train to ``steps``. Returns {"dp x tp -> dp' x tp'": {kind: checks}} and the bytes
    of the source's hand-format shard files, summed over its ranks, read from the disk."""
    for dp, tp in (src,) + tuple(dsts):
        megatron.check_degree(cfg or tiny.GPTConfig(), tp)
        if training.GLOBAL_BATCH % dp:
            raise ValueError(f"dp={dp} does not divide the global batch of {training.GLOBAL_BATCH}; "
                             "use 1, 2, 3, 4, 6 or 12.")
    with tempfile.TemporaryDirectory(prefix="ckpt-layout-") as root:
        a = launch.spawn(run_both, src[0] * src[1], root, steps, src[1], save_at, timeout=timeout, cfg=cfg)[0]
        folder = os.path.join(root, "hand", f"step-{save_at}")
        out = {"hand_bytes_on_disk": sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
                                         if n.endswith(".bin"))}
        for dp, tp in dsts:
            b = launch.spawn(run_both, dp * tp, root, steps, tp, None, save_at, timeout=timeout, cfg=cfg)[0]
            out[f"{src[0]}x{src[1]} -> {dp}x{tp}"] = {kind: {
                "weights_bit_exact": all(torch.equal(a[kind]["saved"][n], b[kind]["loaded"][n])
                                         for n in a[kind]["saved"]),
                "batches_match": a[kind]["batches"][save_at:] == b[kind]["batches"],
                "max_loss_diff": max(abs(x - y) for x, y in zip(a[kind]["losses"][save_at:],
                                                                b[kind]["losses"])),
                "uninterrupted": a[kind]["losses"], "resumed": b[kind]["losses"]} for kind in ("hand", "dcp")}
    return out
