"""Chapter 12: two pipeline stages that save a tensor under one name, and the save that refuses it.

A stage numbers its layers from 0 (`labs.checkpointing.pipeline_change`): under pp = 2 over 4
layers, stage 0's ``blocks.0`` is global layer 0 and stage 1's ``blocks.0`` is global layer 2.
Keyed by those local names, both stages save ``model.blocks.0.attn.qkv.weight``, different
tensors of the same shape under one key:

- DCP treats a key that several ranks hold as one replicated tensor and writes it once: its save
  planner drops every duplicate write item but one (``dedup_save_plans`` keeps the copy of the
  rank whose plan is smallest so far, torch/distributed/checkpoint/_dedup_save_plans.py). The other
  stage's layer is silently never written.
- the hand format (`sharded_checkpoint`) writes both, since each rank writes what it holds; its
  loader then finds each clashing key's elements covered twice and refuses the load
  (`sharded_checkpoint.CoverageError`): nothing is lost silently, but the checkpoint is unusable.

The lab saves such a state both ways and reads back what was written, then the same save with
`one_name.check_one_name` first: one name must mean one value wherever ranks overlap, so a key that
two ranks save must hold the same bytes on both wherever their elements overlap (data-parallel
replicas do; two stages do not).
With the book's global names (`pipeline_change.global_name`: local layer i of stage s is layer
s L/p + i) no two stages share a key, and the check passes.

    python -m labs.checkpointing.key_clash --json
"""
import os
import tempfile

import torch

from labs import model as tiny
from labs.launcher import launch
from labs.pipeline import executor
from labs.checkpointing import one_name, pipeline_change as pc, sharded_checkpoint as sc

CFG = tiny.GPTConfig(n_layer=4)


def _state(kind, piece, stage, per_stage, names):
    model = {}
    for n, p in piece.named_parameters():
        key = names(n, stage, per_stage)
        model[key] = p.data if kind == "dcp" else sc.Shard(p.data.view(-1), 0, tuple(p.shape))
    return {"model": model}


def _save(kind, state, path, check):
    if check:
        one_name.check_one_name(state)
    if kind == "hand":
        sc.save(state, path)
    else:
        import torch.distributed.checkpoint as dcp
        dcp.save(state, checkpoint_id=path)


def _read_back(kind, path, like):
    """The tensors the checkpoint gives back for ``like``'s keys (loaded into fresh zeros)."""
    state = {"model": {}}
    for k, v in like["model"].items():
        t = torch.zeros_like(v.tensor if isinstance(v, sc.Shard) else v)
        state["model"][k] = sc.Shard(t, v.offset, v.shape) if isinstance(v, sc.Shard) else t
    if kind == "hand":
        sc.load(state, path)
    else:
        import torch.distributed.checkpoint as dcp
        dcp.load(state, checkpoint_id=path)
    return {k: (v.tensor if isinstance(v, sc.Shard) else v).clone() for k, v in state["model"].items()}


@launch.on_cpu("the clash is in the names: DCP's save planner and the hand format's loader act on keys "
               "whatever the device, and the hand writer saves CPU tensors (.numpy())")
def clash(rank, world_size, root):
    """Each rank is one pipeline stage. Save under local names (unchecked, then checked) and under
    global names (checked), by hand and with DCP; report what each rank gets back."""
    piece = executor.split(tiny.build(CFG, seed=0), world_size)[rank]
    per_stage = CFG.n_layer // world_size
    local = _state("hand", piece, rank, per_stage, pc.local_as_global)["model"]
    out = {"digests": {k: one_name._digest(v.tensor) for k, v in local.items()}}   # the bytes, per key
    for kind in ("hand", "dcp"):
        for names, check in ((pc.local_as_global, False), (pc.local_as_global, True), (pc.global_name, True)):
            tag = f"{kind}-{names.__name__}-{'checked' if check else 'unchecked'}"
            path = os.path.join(root, tag)
            state = _state(kind, piece, rank, per_stage, names)
            try:
                _save(kind, state, path, check)
            except ValueError as exc:
                out[tag] = {"refused": str(exc), "written": os.path.exists(path)}
                continue
            try:
                back = _read_back(kind, path, state)
            except sc.CoverageError as exc:
                out[tag] = {"refused": None, "load_refused": str(exc).replace(path, tag),   # no tmp path
                            "written_by": pc.written(kind, path) if rank == 0 else None}
                continue
            mine = {k: (v.tensor if isinstance(v, sc.Shard) else v) for k, v in state["model"].items()}
            lost = sorted(k for k in mine if not torch.equal(back[k].reshape(-1), mine[k].reshape(-1)))
            out[tag] = {"refused": None, "keys": len(mine), "lost": lost,
                        "written_by": pc.written(kind, path) if rank == 0 else None}
    return out


def key_clash(world_size=2, timeout=120.0):
    """Two stages (world_size ranks, pp = world_size) save under local and under global names."""
    if world_size < 2 or CFG.n_layer % world_size:
        raise ValueError(f"--world-size {world_size}: the clash needs 2 or 4 stages of the "
                         f"{CFG.n_layer}-layer model.")
    with tempfile.TemporaryDirectory(prefix="ckpt-clash-") as root:
        per_rank = launch.spawn(clash, world_size, root, timeout=timeout)
    digests = [r.pop("digests") for r in per_rank]
    # counted from the stages' own tensors: keys several stages hold under one name, with other bytes
    out = {"differing_keys": sorted(k for k in set().union(*digests)
                                    if len({d[k] for d in digests if k in d}) > 1)}
    for tag in per_rank[0]:
        ranks = [r[tag] for r in per_rank]
        refused = [r["refused"] for r in ranks]
        out[tag] = {"refused": refused[0], "refused_on_every_rank": all(refused),
                    "written": any(r.get("written") for r in ranks)}
        if not any(refused):
            load_refused = [r.get("load_refused") for r in ranks]
            if any(load_refused):
                out[tag].update(load_refused=next(m for m in load_refused if m),
                                load_refused_on_every_rank=all(load_refused))
            else:
                out[tag].update(lost={rank: r["lost"] for rank, r in enumerate(ranks)},
                                keys=[r["keys"] for r in ranks])
            out[tag].update(writers={k: sorted(r for r, keys in ranks[0]["written_by"].items() if k in keys)
                                     for k in sorted(set().union(*ranks[0]["written_by"].values()))})
    return out


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Two pipeline stages save a layer under one local name: DCP drops one, the hand format's "
                   "load refuses the doubly covered keys; the checked save refuses it.", world_size_default=2)
    args = cli.parse(p, argv)
    r = key_clash(args.world_size, args.timeout)
    tags = {tag: res for tag, res in r.items() if tag != "differing_keys"}
    lost = {tag: sum(len(v) for v in res["lost"].values()) for tag, res in tags.items() if "lost" in res}
    cli.report(r, args, f"keys with other bytes on another stage: {len(r['differing_keys'])}; entries lost "
               f"per unchecked save: {lost}; refused at load: "
               f"{[tag for tag, res in tags.items() if res.get('load_refused')]}; "
               "checked local names refused: "
               f"{[tag for tag, res in tags.items() if res['refused']]}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
