"""Chapter 12: a checkpoint saved under one pipeline degree and loaded under another.

A pipeline stage holds whole layers: of p stages over L layers, stage s holds global layers
[s L/p, (s+1) L/p), the first stage also the embeddings, the last also the final LayerNorm and
the head (the tiny GPT does not tie its head to the embedding, so no weight lives on two stages).
A stage is a module of its own, and inside it the layers are numbered from 0: its state dict
says ``blocks.0``, whatever layer that is. The checkpoint must key every tensor by the model's
global name, local layer i of stage s being global layer s L/p + i (`global_name`); then a change
of p changes only which keys each rank reads. The plausible bug keys a stage's layers by their
local names (`local_as_global`): every stage reads global layer 0 into its first layer, no
shape differs, and nothing fails unless the loader checks that every saved key was read by
some rank (`check_coverage`).

Trained with chapter 5's hand 1F1B executor (`labs.pipeline.pipeline_dp.Executor`) on pp x dp
ranks, each stage's gradients averaged over its data-parallel group, each rank's Adam over its
stage. Two formats: the hand format (`sharded_checkpoint`: data-parallel rank 0 of each stage
writes its stage's keys) and DCP (``dcp.save`` of every rank's state dict under global names;
DCP writes a key that several ranks hold once). Both load under another pp, and the loader
records which keys each rank read: the hand format through ``sc.load(reads=...)``, DCP through
its load plan (`_Recording`).

Another (pp, dp) cuts the global batch into other micro-batches and replicas, so the gradient is
summed in another order: the weights load bit for bit, the losses after the load stay within
`resharding.LOSS_TOL` of the uninterrupted run rather than equal.

    python -m labs.checkpointing.pipeline_change --world-size 4 --json
"""
import os
import tempfile

import torch
import torch.distributed as dist

from labs import groups, model as tiny
from labs.dims import ParallelDims
from labs.launcher import launch
from labs.formulas import schedules
from labs.pipeline import executor, pipeline_dp
from labs.checkpointing import one_name, resharding as ck, sharded_checkpoint as sc, training
from labs.checkpointing.stateful_loader import StatefulLoader

CFG = tiny.GPTConfig(n_layer=4)   # 4 layers: pp = 1, 2 and 4 all hold whole layers
MICRO = 3                         # samples per micro-batch: m = 12 / (3 dp) per replica
ADAM = ("exp_avg", "exp_avg_sq", "step")
KINDS = ("hand", "dcp")


def global_name(local, stage, per_stage):
    """A stage's parameter name in the whole model: local ``blocks.i`` is global ``blocks.{s L/p + i}``."""
    parts = local.split(".")
    if parts[0] == "blocks":
        parts[1] = str(stage * per_stage + int(parts[1]))
    return ".".join(parts)


def local_as_global(local, stage, per_stage):
    """The bug: the stage's own name, as if every stage started at layer 0."""
    return local


class _Executor(pipeline_dp.Executor):
    """The 1F1B executor that also adds up the last stage's loss (each micro-batch's is already / m)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss = torch.zeros(())

    def _F(self, a, k):
        ready = super()._F(a, k)
        if k == self.p - 1:
            self.loss += self.saved[(a.mb, a.chunk)]["out"].detach()
        return ready


def _state(kind, named, opt, holds=True):
    """{"model": {name: weight}, "optim": {name: {exp_avg, exp_avg_sq, step}}} under global names;
    the hand format wraps each tensor as a `sc.Shard` covering all of it."""
    model, optim = {}, {}
    for name, p in named if holds else []:
        st = opt.state[p]
        if kind == "dcp":
            model[name], optim[name] = p.data, {k: st[k] for k in ADAM}
        else:
            model[name] = sc.Shard(p.data.view(-1), 0, tuple(p.shape))
            optim[name] = {k: sc.Shard(st[k].view(-1), 0, tuple(st[k].shape)) for k in ADAM}
    return {"model": model, "optim": optim}


def _recording_planner():
    """DCP's default load planner, keeping the keys of this rank's read plan (what DCP reads for it)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Recording(DefaultLoadPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            self.keys = sorted({item.dest_index.fqn for item in plan.items})
            return plan
    return Recording()


def _load(kind, named, opt, sched, loader, path):
    """Load this rank's keys; returns the weight and Adam keys the loader read, as it recorded them."""
    ck._init_adam(opt)
    extra = {"loader": loader.state_dict(), "lr_step": 0, "rng": torch.get_rng_state()}
    state = {**_state(kind, named, opt), "extra": extra}
    if kind == "hand":
        reads = []
        values = sc.load(state, path, reads=reads)
        extra["loader"] = {k.split(".")[-1]: v for k, v in values.items() if k.startswith("extra.loader.")}
        extra["lr_step"] = values["extra.lr_step"]
        keys = [k for k, _ in reads]
    else:
        import torch.distributed.checkpoint as dcp
        planner = _recording_planner()
        dcp.load(state, checkpoint_id=path, planner=planner)
        extra, keys = state["extra"], planner.keys
    training.resume(extra, opt, sched, loader)
    return sorted({k for k in keys if k.startswith(("model.", "optim."))})


def written(kind, path):
    """{rank: sorted weight and Adam keys in the file that rank wrote}, read from the disk."""
    out = {}
    if kind == "hand":
        import json
        for name in sorted(n for n in os.listdir(path) if n.endswith(".json") and n.startswith("rank")):
            with open(os.path.join(path, name)) as f:
                out[int(name[4:-5])] = sorted(k for k in json.load(f) if k.startswith(("model.", "optim.")))
        return out
    import torch.distributed.checkpoint as dcp
    for idx, info in dcp.FileSystemReader(path).read_metadata().storage_data.items():
        if idx.fqn.startswith(("model.", "optim.")):
            out.setdefault(int(info.relative_path.split("_")[2]), []).append(idx.fqn)
    return {r: sorted(keys) for r, keys in sorted(out.items())}


def check_coverage(read_by_rank, saved, path):
    """Refuse a load in which some saved weight or Adam key was read by no rank: every tensor of
    the model lives on some stage, so a full load reads every key at least once. It passes a wrong
    naming that reads every key once (layer i + l p for i L/p + l); the weight comparison refuses that."""
    missing = sorted(set().union(*saved.values()) - set().union(*map(set, read_by_rank)))
    if missing:
        raise ValueError(f"{len(missing)} saved entries of {os.path.basename(path)} were read by no rank "
                         f"({', '.join(parts(missing))}): a stage loaded its layers under the wrong global "
                         "names (local layer i of stage s is global layer s L/p + i).")


def parts(keys):
    """Keys shortened to the model's parts, in order: tok_emb, pos_emb, blocks.0, ..., ln_f, head."""
    out = []
    for k in keys:
        bits = k.split(".")[1:]
        part = ".".join(bits[:2]) if bits[0] == "blocks" else bits[0]
        if part not in out:
            out.append(part)
    order = lambda p: (p != "tok_emb", p != "pos_emb", p in ("ln_f", "head"), p == "head",   # noqa: E731
                      int(p.split(".")[1]) if p.startswith("blocks.") else 0)
    return sorted(out, key=order)


def _full(piece, grid):
    """{global name: weight} of the whole model, from data-parallel rank 0 of every stage (checks only;
    `executor.Piece.named` holds the names the whole model gives, not the stage's)."""
    mine = {n: q.detach().clone() for n, q in piece.named} if grid.coords["dp"] == 0 else {}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {n: t for d in everyone for n, t in d.items()}


def run(rank, world_size, kind, root, steps, pp, save_at=None, load_at=None, cfg=None, names=global_name,
        check=True):
    """Train the tiny GPT under (pp, dp = world_size / pp) with 1F1B; save after ``save_at`` steps, or
    start from ``load_at`` (written under any pp), keying stage tensors by ``names``. Returns the
    global mean loss of each step, the global sample ids of each step, the full weights at the
    save or just after the load, and the keys every rank read (after a load)."""
    cfg, dev = cfg or CFG, launch.device()
    lay = ParallelDims.build(world_size, pp=pp)
    grid = groups.Groups(lay)
    stage, dp_rank, dp = grid.coords["pp"], grid.coords["dp"], lay.dp
    piece = executor.split(tiny.build(cfg, seed=0, device=dev), pp)[stage]
    named = [(names(n, stage, cfg.n_layer // pp), q) for n, q in piece.named_parameters()]
    opt, sched = training.optimizer(piece)
    loader = StatefulLoader(training.NUM_SAMPLES, training.GLOBAL_BATCH, dp_rank, dp)
    out, first = {"losses": [], "batches": []}, 0
    if load_at is not None:
        path = os.path.join(root, f"step-{load_at}")
        out["read_by_rank"] = [None] * world_size
        dist.all_gather_object(out["read_by_rank"], _load(kind, named, opt, sched, loader, path))
        out["loaded"], first = _full(piece, grid), load_at
        if check:
            check_coverage(out["read_by_rank"], written(kind, path), path)
    for step in range(first, steps):
        ids = loader.next()
        x, y = training.masked_batch(cfg, ids, dp_rank, dp, dev)   # every rank draws: one RNG stream
        m = len(ids) // MICRO
        data = [(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]) for i in range(m)]
        ex = _Executor([piece], stage, pp, 1, schedules.costs("1f1b"), 0.0, data, m, cfg.hidden,
                       stage_ranks=grid.pp_ranks)
        ex.run(schedules.one_f_one_b(pp, m)[stage])
        flat = torch.cat([q.grad.reshape(-1) for q in piece.parameters()])
        dist.all_reduce(flat, group=grid.dp)                    # the stage's replicas' gradients
        flat /= dp
        at = 0
        for q in piece.parameters():
            q.grad.copy_(flat[at:at + q.numel()].view_as(q))
            at += q.numel()
        opt.step()
        sched.step()
        opt.zero_grad()
        total = ex.loss.clone()                                 # zero except on the last stage
        dist.all_reduce(total)
        seen = [None] * world_size
        dist.all_gather_object(seen, (stage, ids))
        out["losses"].append(total.item() / dp)
        out["batches"].append([i for s, b in seen if s == 0 for i in b])
        if save_at is not None and step + 1 == save_at:
            path = os.path.join(root, f"step-{save_at}")
            state = {**_state(kind, named, opt, kind == "dcp" or dp_rank == 0), "extra": ck._extra(loader,
                                                                                                   sched)}
            one_name.check_one_name(state)     # two stages under one name would lose one (key_clash)
            if kind == "hand":
                sc.save(state, path)           # data-parallel rank 0 of each stage writes that stage
            else:
                import torch.distributed.checkpoint as dcp
                dcp.save(state, checkpoint_id=path)   # DCP keeps one copy of a key several ranks hold
            out["saved"] = _full(piece, grid)
    return out


@launch.on_cpu(sc.ON_CPU)
def _job(rank, world_size, root, steps, save_at, src, dsts, cfg):
    """Every run in one job: the uninterrupted run under ``src``, a load under each of ``dsts``, for
    both formats, and a load under the last of ``dsts`` that keys stages by their local names."""
    out = {}
    for kind in KINDS:
        folder = os.path.join(root, kind)
        out[kind] = {"src": run(rank, world_size, kind, folder, steps, src, save_at, cfg=cfg)}
        for pp in dsts:
            out[kind][pp] = run(rank, world_size, kind, folder, steps, pp, None, save_at, cfg)
    out["wrong"] = run(rank, world_size, "hand", os.path.join(root, "hand"), steps, dsts[-1], None, save_at,
                       cfg,
                       local_as_global, check=False)
    return out if rank == 0 else None


def change_pipeline(src=2, dsts=(2, 1, 4), world_size=4, steps=5, save_at=3, timeout=180.0, cfg=None):
    """Train under (pp, dp) = (``src``, world_size / src), save after ``save_at`` steps, load under
    each pp of ``dsts`` and train to ``steps``, by hand and with DCP; then the local-names bug.
    Returns {"2 -> 1": {kind: checks, keys read per rank}, ..., "written": {kind: {rank: keys}},
    "wrong_names": what the bug loads and whether `check_coverage` refuses it}."""
    cfg = cfg or CFG
    for pp in (src,) + tuple(dsts):
        ParallelDims.build(world_size, pp=pp)
        if cfg.n_layer % pp or (training.GLOBAL_BATCH // (world_size // pp)) % MICRO:
            raise ValueError(f"pp={pp} on {world_size} ranks does not give whole layers of {cfg.n_layer} "
                             f"and whole micro-batches of {MICRO} samples; use a pp dividing both.")
    with tempfile.TemporaryDirectory(prefix="ckpt-pipeline-") as root:
        res = launch.spawn(_job, world_size, root, steps, save_at, src, tuple(dsts), cfg, timeout=timeout)[0]
        out = {"written": {k: written(k, os.path.join(root, k, f"step-{save_at}")) for k in KINDS}}
        for pp in dsts:
            out[f"{src} -> {pp}"] = {kind: _compare(res[kind]["src"], res[kind][pp], save_at)
                                     for kind in KINDS}
        bug = _compare(res["hand"]["src"], res["wrong"], save_at)
        try:
            check_coverage(bug["read_by_rank"], out["written"]["hand"], f"step-{save_at}")
            bug["refused"] = None
        except ValueError as e:
            bug["refused"] = str(e)
        a = res["hand"]["src"]["saved"]
        bug["wrong_weights"] = parts([f"model.{n}" for n in a if not torch.equal(a[n],
                                                                                 res["wrong"]["loaded"][n])])
        out["wrong_names"] = bug
    return out


def _compare(a, b, k):
    tail = a["losses"][k:]
    return {"weights_bit_exact": all(torch.equal(a["saved"][n], b["loaded"][n]) for n in a["saved"]),
            "batches_match": a["batches"][k:] == b["batches"],
            "losses_bit_exact": tail == b["losses"],
            "max_loss_diff": max(abs(x - y) for x, y in zip(tail, b["losses"])),
            "uninterrupted": a["losses"], "resumed": b["losses"], "read_by_rank": b["read_by_rank"]}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("A checkpoint saved under pp = 2 stages, loaded under pp = 1 and 4.", world_size_default=4)
    args = cli.parse(p, argv)
    if args.world_size != 4:
        raise ValueError(f"--world-size {args.world_size}: this lab runs (pp, dp) = (2, 2), (1, 4) and "
                         "(4, 1); use 4.")
    res = change_pipeline(timeout=args.timeout)
    ok = all(c[k]["weights_bit_exact"] and c[k]["batches_match"] and c[k]["max_loss_diff"] < ck.LOSS_TOL
             for c in (res["2 -> 1"], res["2 -> 4"]) for k in KINDS)
    same = all(res["2 -> 2"][k]["losses_bit_exact"] for k in KINDS)
    bug = res["wrong_names"]
    result = {"world_size": 4, "loads_match": ok, "same_layout_bit_exact": same,
              "wrong_names_refused": bug["refused"] is not None,
              "wrong_names_max_loss_diff": bug["max_loss_diff"]}
    cli.report(result, args,
               f"pp 2 -> 2 bit for bit: {same}; 2 -> 1 and 2 -> 4 weights exact and losses within "
               f"{ck.LOSS_TOL:g}: {ok}; local names refused: {result['wrong_names_refused']}")

if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
