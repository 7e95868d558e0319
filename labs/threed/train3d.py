"""Chapter 17: the tiny GPT trained on dp x tp x pp (and cp) processes, built from chapters 3 to 6's pieces.

Every rank takes its place on the layout's grid (`labs.dims.ParallelDims`, its process groups from
`labs.groups`) and applies, from outside, to the plain model (`build_rank`):
- pipeline parallelism: the model cut into pp stages (`labs.pipeline.executor.split`), stepped by
  the hand 1F1B schedule and executor of chapter 5 (`schedules.one_f_one_b`, `executor.Executor`);
- tensor parallelism inside each stage: Megatron's column- and row-parallel layers, f and g
  (`labs.tensor_parallel.megatron.apply_tensor_parallel`, chapter 4);
- context parallelism: each block's attention replaced by chapter 6's all-gather attention
  (`labs.context_parallel.allgather_cp`, Llama 3's method) on this rank's zig-zag rows, and the
  position table read at those rows (`apply_context_parallel`);
- ZeRO-1 over the dp x cp ranks that hold the same weights (`labs.zero.sharded_optimizer`, chapter 3).
Every collective runs as chapter 2's hand ring (`hand_ring.hand_collectives`), so every byte is a
counted message: in forward and backward each is filed by the coordinate its destination differs
in (`bytes_by_group`), in the optimizer step by whether it stays in the ZeRO-1 group (`zero_bytes`).

    python -m labs.threed.train3d --dp 2 --tp 2 --pp 2 --json
    python -m labs.threed.train3d --dp 2 --cp 2 --tp 2 --json
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labs import groups, model as tiny
from labs.dims import ParallelDims
from labs.context_parallel import allgather_cp, methods, ring_attention
from labs.data_parallel import hand_ring
from labs.launcher import launch
from labs.measure import comm
from labs.formulas import schedules
from labs.pipeline import executor
from labs.threed import gradcheck, layout3d
from labs.tensor_parallel import megatron
from labs.zero.sharded_optimizer import ShardedOptimizer


class Executor(executor.Executor):
    """Chapter 5's executor between the global ranks of this rank's pipeline. A message is the
    activation (or its gradient) alone, without the executor's logical clock; the timeline is not
    wanted here, and every byte sent is then model data. Keeps the last stage's losses."""

    def __init__(self, *args, stage_ranks, **kwargs):
        super().__init__(*args, **kwargs)
        self.stage_ranks, self.losses = stage_ranks, []

    def _send(self, t, dst, tag, clock):
        self.pending.append(comm.isend(t.detach().contiguous(), self.stage_ranks[dst], tag=tag))

    def _recv(self, shape, src, tag):
        buf = torch.empty(shape)
        comm.irecv(buf, self.stage_ranks[src], tag=tag).wait()
        return buf, 0.0

    def _F(self, a, k):
        ready = super()._F(a, k)
        if self.pieces[0].last:   # the loss of this micro-batch (the executor stored it divided by m)
            self.losses.append(self.saved[(a.mb, a.chunk)]["out"].item() * self.m)
        return ready


class Positions(nn.Module):
    """The position table read at this rank's rows: local position i is global position rows[i]."""

    def __init__(self, table, rows):
        super().__init__()
        self.table = table
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, idx):                                   # idx = arange(s/cp), from the model
        return self.table(self.rows[idx])


class ContextParallelAttention(nn.Module):
    """The model's attention with its core replaced by all-gather CP over ``group``: the same qkv
    and proj (tensor-parallel or not), K and V gathered from every CP rank (rows in ``table``)."""

    def __init__(self, attn, group, table, gather=None):
        super().__init__()
        self.qkv, self.proj, self.n_head = attn.qkv, attn.proj, attn.n_head
        self.group, self.table = group, table
        self.gather = gather or allgather_cp.GatherSequence.apply

    def forward(self, x):                                     # (B, s/cp, h)
        q, k, v = self.qkv(x).chunk(3, dim=2)                 # 3 x (B, s/cp, a/tp * d)
        B, T, _ = q.shape
        d = q.size(-1) // self.n_head
        q, k, v = (t.view(B, T, self.n_head, d).transpose(1, 2) for t in (q, k, v))  # (B, a/tp, s/cp, d)
        r = dist.get_rank(self.group)
        k_all, v_all = self.gather(k, self.group), self.gather(v, self.group)        # (B, a/tp, s, d)
        everyone = [c for chunks in self.table for c in chunks]
        y, _ = ring_attention.attend(q, k_all, v_all, self.table[r], everyone, causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, -1))


def apply_context_parallel(piece, group, seq, gather=None):
    """Every block's attention under all-gather CP, and the position table read at this rank's rows."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    table = methods.layout(cp, seq, "zigzag")
    for block in piece.blocks:
        block.attn = ContextParallelAttention(block.attn, group, table, gather)
    if piece.first:
        piece.pos_emb = Positions(piece.pos_emb, layout3d.cp_rows(seq, cp, r))
    return piece


def build_rank(cfg, g, bugs=(), seed=0):
    """This rank's stage of the plain tiny GPT (of seed ``seed``), with TP and CP applied from outside."""
    lay, c = g.dims, g.coords
    piece = executor.split(tiny.build(cfg, seed=seed), lay.pp)[c["pp"]]
    megatron.apply_tensor_parallel(piece, g.tp)
    if lay.cp > 1:
        apply_context_parallel(piece, g.cp, cfg.seq_len, gather=_bug_gather() if "cp_backward" in bugs
                               else None)
    if "tp_backward" in bugs:
        _drop_f_backward(piece)
    if "ln_summed" in bugs:    # replicated LayerNorms' gradients summed over tp (x tp), not averaged
        for p in (p for n, p in piece.named_parameters() if n.split(".")[-2].startswith("ln")):
            p.register_hook(lambda grad, k=lay.tp: grad * k)
    return piece


def bytes_by_group(tally, dims, rank, peers=None):
    """Counted bytes this rank sent (to ``peers`` only, if given), per group: each destination differs
    from this rank in one coordinate of the grid, the axis of the group the message went through."""
    mine = dims.coords(rank)
    out = dict.fromkeys(mine, 0)
    for peer, nbytes in tally.sent_to.items():
        if peers is not None and peer not in peers:
            continue
        axes = "+".join(a for a, v in dims.coords(peer).items() if v != mine[a])
        out[axes] = out.get(axes, 0) + nbytes
    return out


def train(rank, world_size, dims, variants=((),), steps=layout3d.STEPS, lr=layout3d.LR,
          micro_batch=layout3d.MICRO_BATCH, num_microbatches=layout3d.MICROBATCHES, seeds=None):
    """Train ``steps`` steps once per variant (a tuple of deliberate bugs, () for the correct layout,
    and "weight_decay" for Adam with coupled weight decay `layout3d.WEIGHT_DECAY`), in one job, each
    on the model and batches of its seed (``seeds``, one per variant; all 0 by default). Per variant
    and step: the losses of this rank's micro-batches (last stage only), the counted bytes it sent per
    group in forward and backward ("passes") and in the optimizer step ("update": ZeRO-1's
    reduce-scatter and all-gather), and the bytes it sent to another node."""
    g, nodes = groups.Groups(dims), _nodes()
    return [_train(g, layout3d.config(), steps, lr, micro_batch, num_microbatches, bugs, nodes, seed)
            for bugs, seed in zip(variants, seeds or [0] * len(variants))]


def _train(g, cfg, steps, lr, b, m, bugs, nodes, seed):
    lay, c, rank = g.dims, g.coords, g.rank
    piece = build_rank(cfg, g, bugs, seed)
    opt, zero_ranks = _optimizer(piece, g, lr, bugs)
    rows = layout3d.cp_rows(cfg.seq_len, lay.cp, c["cp"])
    out = {"rank": rank, "coords": c, "last": c["pp"] == lay.pp - 1, "losses": [], "sent": [], "crossing": []}
    with hand_ring.hand_collectives():
        for step in range(steps):
            batches = layout3d.step_batches(cfg, step, lay.dp, m, b, seed)[c["dp"] * m:(c["dp"] + 1) * m]
            data = [(x[:, rows], y[:, rows]) for x, y in batches]
            if "pp_targets" in bugs and out["last"]:   # the last stage reads the next micro-batch's targets
                data = [(x, data[(i + 1) % m][1]) for i, (x, _) in enumerate(data)]
            ex = Executor([piece], c["pp"], lay.pp, 1, schedules.costs("1f1b"), 0.0, data, m, cfg.hidden,
                          stage_ranks=g.pp_ranks)
            with comm.counting() as passes:
                ex.run(schedules.one_f_one_b(lay.pp, m)[c["pp"]])
            with comm.counting() as update:
                if step == 0:    # the reduced step-1 gradient, `gradcheck`: the step's own reduce-scatter
                    out["grad1"] = gradcheck.shards(opt, piece)
                opt.step()
                opt.zero_grad()
            away = {peer for peer, node in enumerate(nodes) if node != nodes[rank]}
            out["losses"].append(ex.losses)
            out["sent"].append({"passes": bytes_by_group(passes, lay, rank),
                                "update": zero_bytes(update, zero_ranks)})
            out["crossing"].append({"passes": bytes_by_group(passes, lay, rank, away),
                                    "update": zero_bytes(update, zero_ranks, away)})
    out["nodes"] = nodes
    return out


def zero_bytes(tally, zero_ranks, peers=None):
    """Counted bytes this rank sent in the optimizer step (to ``peers`` only, if given): "dp" to the
    ranks of its ZeRO-1 group, the dp (x cp) ranks that hold the same weights, "other" to any other."""
    out = {"dp": 0, "other": 0}
    for peer, nbytes in tally.sent_to.items():
        if peers is None or peer in peers:
            out["dp" if peer in zero_ranks else "other"] += nbytes
    return out


def _optimizer(piece, g, lr, bugs):
    """ZeRO-1 over the ranks that hold the same weights, and those ranks (the group it should use)."""
    group, ranks = (g.dp_cp, g.dp_cp_ranks) if g.dims.cp > 1 else (g.dp, g.dp_ranks)
    if "zero_wrong_group" in bugs:   # a bug: ZeRO-1 over dp x tp, a group of the same size, other weights
        for r in g.dims.groups(("dp", "tp")):
            new = dist.new_group(r)                   # a collective: every rank makes every group
            if g.rank in r:
                group = new
    decay = layout3d.WEIGHT_DECAY if "weight_decay" in bugs else 0.0   # a setting, not a bug
    opt = ShardedOptimizer(piece.parameters(), torch.optim.Adam, stage=1, group=group, lr=lr,
                           weight_decay=decay)
    if "dp_not_averaged" in bugs:    # the sum over replicas, not the mean
        opt.n = 1
    if "dp_not_reduced" in bugs:     # each rank steps its shard on its own replica's gradient alone
        opt._reduce_bucket = lambda b: b.grad[b.lo:b.lo + b.shard].clone()
    return opt, ranks


def _nodes():
    """The node (torchrun's GROUP_RANK; 0 under spawn) of every rank, gathered before any counting."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, int(os.environ.get("GROUP_RANK", 0)))
    return everyone


def _drop_f_backward(piece):
    """A bug: the column-parallel layers without f, so the input gradient is never all-reduced."""
    for layer in piece.modules():
        if isinstance(layer, megatron.ColumnParallelLinear):
            layer.forward = lambda x, layer=layer: F.linear(x, layer.weight, layer.bias)


class _GatherNoReduce(torch.autograd.Function):
    """A bug: K and V gathered, but backward keeps only this rank's rows of dK, dV (no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.n, ctx.r = dist.get_world_size(group), dist.get_rank(group)
        return allgather_cp.GatherSequence.forward(ctx, x, group)

    @staticmethod
    def backward(ctx, g):
        rows = g.shape[2] // ctx.n
        return g[:, :, ctx.r * rows:(ctx.r + 1) * rows].contiguous(), None


def _bug_gather():
    return _GatherNoReduce.apply


def summarize(results, variant=0):
    """One variant of a run, from every rank's result: the loss of each step (the mean over all
    micro-batches of every replica, and over CP ranks' equal shares of the tokens), and per rank the
    counted bytes of each step per group (dp: everything the optimizer step sent)."""
    runs = [r[variant] for r in results]
    last = [r for r in runs if r["last"] and r["coords"]["tp"] == 0]
    steps = len(last[0]["losses"])
    losses = [sum(sum(r["losses"][t]) for r in last) / sum(len(r["losses"][t]) for r in last)
              for t in range(steps)]
    return {"losses": losses, "sent": [[_per_group(s) for s in r["sent"]] for r in runs],
            "crossing": [[_per_group(s) for s in r["crossing"]] for r in runs],
            "coords": [r["coords"] for r in runs], "nodes": runs[0]["nodes"],
            "grad1": [r["grad1"] for r in runs]}


def _per_group(sent):
    """tp, pp, cp from forward and backward, dp from the optimizer step to the rank's ZeRO-1 group;
    "other": any message in forward and backward to a rank off this rank's tp, pp and cp groups, and
    any in the optimizer step to a rank off its ZeRO-1 group (none, in a correct run)."""
    passes, update = sent["passes"], sent["update"]
    return {"tp": passes["tp"], "pp": passes["pp"], "cp": passes["cp"], "dp": update["dp"],
            "other": update["other"] + sum(v for k, v in passes.items() if k not in ("tp", "pp", "cp"))}


def run(dims, variants=((),), steps=layout3d.STEPS, lr=layout3d.LR, micro_batch=layout3d.MICRO_BATCH,
        num_microbatches=layout3d.MICROBATCHES, timeout=300, seeds=None):
    """Check the layout (a `ParallelDims`) against the model, spawn the ranks, summarize every variant
    (each on the run of its seed in ``seeds``, 0 by default)."""
    layout3d.check(layout3d.config(), dims, micro_batch=micro_batch, num_microbatches=num_microbatches)
    results = launch.spawn(train, dims.world_size, dims, variants, steps, lr, micro_batch, num_microbatches,
                           seeds, timeout=timeout)
    return [summarize(results, i) for i in range(len(variants))]


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("The tiny GPT on dp x tp x pp x cp processes (ZeRO-1, Megatron TP, 1F1B, all-gather CP), "
                   "its losses beside one process's and its bytes per group beside the prediction.",
                   world_size_default=None)
    layout3d.add_options(p, cli)
    p.add_argument("--lr", type=cli.positive_float, default=layout3d.LR)
    args = cli.parse(p, argv)
    cfg, degrees = layout3d.config(), {a: getattr(args, a) for a in layout3d.AXES}
    if args.world_size is None:
        d = ParallelDims(**degrees)
    else:
        d = ParallelDims.build(args.world_size, **degrees)
    layout3d.check(cfg, d, micro_batch=args.micro_batch, num_microbatches=args.microbatches)
    results = launch.launch(train, d.world_size, d, ((),), args.steps, args.lr, args.micro_batch,
                            args.microbatches, timeout=args.timeout)
    if results is None:
        return
    r = summarize(results)
    ref = layout3d.reference(cfg, d.dp, args.microbatches, args.micro_batch, args.steps, args.lr)["losses"]
    shape = (cfg, d, args.micro_batch, args.microbatches, cfg.seq_len)
    predicted = [layout3d.predict_bytes_per_group(*shape, c["pp"]) for c in r["coords"]]
    per_node = r["nodes"].count(r["nodes"][0])      # ranks fill torchrun's nodes in order
    result = {"degrees": d.degrees(), "world_size": d.world_size, "losses": r["losses"],
              "reference_losses": ref,
              "max_abs_loss_diff": max(abs(a - b) for a, b in zip(r["losses"], ref)),
              "sent_per_rank": [s[-1] for s in r["sent"]], "predicted_per_rank": predicted,
              "nodes": r["nodes"],
              "crossing_per_rank": [c[-1] for c in r["crossing"]],
              "crossing_predicted_per_rank": [layout3d.crossing_bytes(*shape, rank, per_node)
                                              for rank in range(d.world_size)]}
    cli.report(result, args, f"dp={d.dp} tp={d.tp} pp={d.pp} cp={d.cp} on {d.world_size} ranks: "
               f"losses {[round(x, 5) for x in r['losses']]}, one process {[round(x, 5) for x in ref]}; "
               f"rank 0 sent {result['sent_per_rank'][0]} bytes per group, predicted {predicted[0]}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
