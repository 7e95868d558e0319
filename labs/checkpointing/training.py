"""Chapter 12: the training run every checkpoint lab interrupts, built the same way each time.

The tiny GPT sharded by the hand FSDP or by FSDP2, Adam with a warm-up schedule, and a loader
whose position is part of the state (`labs.checkpointing.stateful_loader`). Each sample is a
function of its id, so a run at any world size sees the same global batches.

Training also draws from the global RNG every step, as dropout does: a random tenth of the input
tokens is replaced by token 0 (`masked_batch`). Every rank draws the mask of the whole global batch
and keeps its own rows, so the draw does not depend on the layout, and a resume that forgets the
RNG state draws other masks and trains on other inputs (the check `rng_match` can fail).
"""
import torch

from labs import model as tiny
from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.checkpointing.stateful_loader import StatefulLoader
from labs.zero import fsdp

GLOBAL_BATCH = 12      # samples per step, divisible by world sizes 1, 2, 3 and 4
NUM_SAMPLES = 60       # one epoch = 5 steps, so a run crosses an epoch boundary
WARMUP = 4             # LR warm-up steps: a schedule restarted from 0 would change the losses
LR = 1e-2
MASK_P = 0.1           # the share of input tokens the global RNG replaces by token 0


def batch(cfg, ids, dev):
    """Each sample is a function of its id, so any split of a global batch sees the same data."""
    xs, ys = zip(*(tiny.synthetic_batch(cfg, 1, seed=i, device=dev) for i in ids))
    return torch.cat(xs), torch.cat(ys)                     # (B_local, T), (B_local, T)


def masked_batch(cfg, ids, dp_rank, dp_size, dev):
    """`batch`, with tokens masked by one draw of the global RNG for the whole global batch.

    Every rank draws the same (GLOBAL_BATCH, T) uniforms (their RNGs are seeded alike) and keeps
    the rows of its own samples: rows [dp_rank * B_local, (dp_rank + 1) * B_local)."""
    x, y = batch(cfg, ids, dev)
    noise = torch.rand(GLOBAL_BATCH, cfg.seq_len)           # (B_global, T), the global RNG
    per = GLOBAL_BATCH // dp_size
    keep = noise[dp_rank * per:(dp_rank + 1) * per] >= MASK_P  # (B_local, T)
    return x * keep.to(dev, x.dtype), y


def build(kind, rank, world_size, cfg, dev, seed=0):
    """The tiny GPT sharded by the hand FSDP (``kind="hand"``) or FSDP2 (``"dcp"``), its Adam, warm-up
    schedule and loader: (model, HandFSDP or None, optimizer, scheduler, loader). ``seed`` sets the
    initial weights and the global RNG that draws the masks."""
    net = tiny.build(cfg, seed=seed, device=dev)
    hand = None
    if kind == "dcp":
        fsdp.fully_shard_units(net, list(net.blocks),
                               device_mesh(ParallelDims(dp=world_size), dev.type)["dp"])
    else:
        hand = fsdp.HandFSDP(net, list(net.blocks))
    opt, sched = optimizer(net)
    return net, hand, opt, sched, StatefulLoader(NUM_SAMPLES, GLOBAL_BATCH, rank, world_size)


def optimizer(net):
    """Adam and its warm-up schedule over ``net``'s parameters (whatever shards they are)."""
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    return opt, sched


def resume(extra, opt, sched, loader, restore_rng=True):
    """Hand a loaded checkpoint's non-tensor state back: the loader's position, the RNG state
    (unless ``restore_rng`` is False) and the LR schedule's step."""
    loader.load_state_dict(extra["loader"])
    if restore_rng:
        torch.set_rng_state(extra["rng"])
    sched.last_epoch = int(extra["lr_step"])     # the schedule resumes at its step, not at 0
    for group, base in zip(opt.param_groups, sched.base_lrs):
        group["lr"] = base * sched.lr_lambdas[0](sched.last_epoch)
