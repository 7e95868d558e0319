"""Chapter 12: how long training stops for a checkpoint, ``dcp.save`` against ``dcp.async_save``.

A synchronous save stops every rank for the whole write. ``dcp.async_save`` stops it only while
the state is copied to host memory (the "staging"); the write then runs in the background and
returns a future that the caller waits on before the next save (PyTorch blog, Pasqualin et al.
2024: a 7B model's checkpoint downtime from 148.8 s to 6.3 s). On a CPU the staging is itself a
memory copy, so the ratio measured here says little about a GPU; it is printed, never asserted.
"""
import os
import tempfile
import time

import torch
import torch.distributed as dist

from labs.launcher import launch
from labs import model as tiny
from labs.checkpointing import sharded_checkpoint as sc, training


def pauses(rank, world_size, root, cfg=None):
    """Seconds training stops for ``dcp.save`` and for ``dcp.async_save`` (until it returns: the
    copy to CPU memory; the write goes on in the background), on the same FSDP2 state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    cfg = cfg or tiny.GPTConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, hidden=256)
    net, _, opt, _, loader = training.build("dcp", rank, world_size, cfg, launch.device())
    net(*training.batch(cfg, loader.next(), launch.device())).backward()
    opt.step()
    msd, osd = get_state_dict(net, opt)
    state = {"model": msd, "optim": osd}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=os.path.join(root, "sync"))
    sync = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=os.path.join(root, "async"))
    paused = time.perf_counter() - t0
    future.result()
    total = time.perf_counter() - t0
    return {"sync_pause_s": sync, "async_pause_s": paused, "async_total_s": total,
            "async_equals_sync": _same_after_load(state, os.path.join(root, "async")),
            "state_bytes_per_rank": sum(t.numel() * t.element_size() for t in _local_tensors(state))}


def _same_after_load(state, checkpoint_id):
    """Whether the background write holds exactly the state it was given: load it into zeroed
    copies of every tensor and compare this rank's pieces bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.utils._pytree import tree_map
    blank = tree_map(lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v, state)
    dcp.load(blank, checkpoint_id=checkpoint_id)
    return all(torch.equal(a, b) for a, b in zip(_local_tensors(state), _local_tensors(blank)))


def _local_tensors(state):
    for _, v in sc._flatten(state):
        if isinstance(v, torch.Tensor):
            yield v.to_local() if hasattr(v, "to_local") else v


def measure_pauses(world_size=2, timeout=60.0):
    """`pauses` on ``world_size`` ranks; the slowest rank's figures (the job waits for it)."""
    with tempfile.TemporaryDirectory(prefix="ckpt-pause-") as root:
        results = launch.spawn(pauses, world_size, root, timeout=timeout)
    out = {k: max(r[k] for r in results) for k in results[0]}
    out["async_equals_sync"] = all(r["async_equals_sync"] for r in results)   # every rank's pieces
    return out
