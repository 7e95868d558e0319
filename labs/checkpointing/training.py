"""Chapter 12: the training run every checkpoint lab interrupts, built the same way each time.

The tiny GPT sharded by the hand FSDP or by FSDP2, Adam with a warm-up schedule, and a loader
whose position is part of the state (`labs.checkpointing.stateful_loader`). Each sample is a
function of its id, so a run at any world size sees the same global batches. Both the resharding
lab (`labs.checkpointing.resharding`) and the pause lab (`labs.checkpointing.async_checkpoint`)
build it here.
"""
import torch

from labs import model as tiny
from labs.checkpointing.stateful_loader import StatefulLoader
from labs.zero import fsdp

GLOBAL_BATCH = 12      # samples per step, divisible by world sizes 1, 2, 3 and 4
NUM_SAMPLES = 60       # one epoch = 5 steps, so a run crosses an epoch boundary
WARMUP = 4             # LR warm-up steps: a schedule restarted from 0 would change the losses
LR = 1e-2


def batch(cfg, ids, dev):
    """Each sample is a function of its id, so any split of a global batch sees the same data."""
    xs, ys = zip(*(tiny.synthetic_batch(cfg, 1, seed=i, device=dev) for i in ids))
    return torch.cat(xs), torch.cat(ys)                     # (B_local, T), (B_local, T)


def build(kind, rank, world_size, cfg, dev):
    """The tiny GPT sharded by the hand FSDP (``kind="hand"``) or FSDP2 (``"dcp"``), its Adam, warm-up
    schedule and loader: (model, HandFSDP or None, optimizer, scheduler, loader)."""
    net = tiny.build(cfg, seed=0, device=dev)
    hand = None
    if kind == "dcp":
        from torch.distributed.device_mesh import init_device_mesh
        fsdp.fully_shard_units(net, list(net.blocks), init_device_mesh(dev.type, (world_size,)))
    else:
        hand = fsdp.HandFSDP(net, list(net.blocks))
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    return net, hand, opt, sched, StatefulLoader(NUM_SAMPLES, GLOBAL_BATCH, rank, world_size)
