"""Chapter 12 on a GPU: how long training pauses for a checkpoint, ``torch.distributed.checkpoint``
saved synchronously (``dcp.save``: the loop waits for the write) and asynchronously
(``dcp.async_save``: the loop waits only while the state is staged to host memory, then a
background thread writes it), for the ~200M model and its AdamW state, one process (world size 1).
Chapter 12's own lab is written separately; this uses DCP directly.
"""
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from labs.measure import memory, timing
from labs import model as tiny
from labs.gpu.figures import figure
from labs.gpu.memory import gpt_200m


def _trained(cfg, sizes, device):
    """The model after one fused-AdamW step under bf16 autocast, so the optimizer has its state."""
    net = tiny.build(cfg, device=device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x, y = tiny.synthetic_batch(cfg, sizes.model_batch, seed=0, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        net(x, y).backward()
    opt.step()
    return net, opt


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _pauses(state, tmp, device):
    """Seconds the caller is blocked by each kind of save, and the async save's total."""
    start = timing.now()
    dcp.save(state, checkpoint_id=os.path.join(tmp, "sync"))
    sync = timing.now() - start
    start = timing.now()
    future = dcp.async_save(state, checkpoint_id=os.path.join(tmp, "async"))
    pause = timing.now() - start       # how long the caller is blocked
    future.result()
    total = timing.now() - start
    return sync, pause, total


def checkpoint_pause(device, sizes):
    """Sync vs async DCP pause; bytes written (files on disk) beside the state's own bytes."""
    cfg = gpt_200m(sizes)
    net, opt = _trained(cfg, sizes, device)
    state = {"model": net.state_dict(), "optim": opt.state_dict()}
    state_bytes = memory.storage_bytes(list(memory.tensors_in(state)))
    tmp = tempfile.mkdtemp(prefix="labs-gpu-dcp-")
    own_group = not dist.is_initialized()
    if own_group:      # DCP coordinates through the default group: one rank, gloo, a file rendezvous
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0,
                                world_size=1)
    try:
        sync, pause, total = _pauses(state, tmp, device)
        written = _dir_bytes(os.path.join(tmp, "sync"))
    finally:
        if own_group:
            dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"sync_pause": figure(sync, "s"), "async_pause": figure(pause, "s"),
            "async_total": figure(total, "s"), "pause_ratio_async_vs_sync": figure(pause / sync, "ratio"),
            "bytes_written": figure(written, "bytes", formula="the state's tensor storage bytes",
                                    formula_value=state_bytes),
            "write_rate_sync": figure(written / sync / 1e9, "GB/s"), "params": tiny.num_params(net)}
