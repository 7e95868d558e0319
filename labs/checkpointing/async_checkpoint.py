"""Chapter 12: what an asynchronous save must copy, and how long training stops for it.

A synchronous save stops every rank for the whole write. ``dcp.async_save`` stops it only while
the state is copied to host memory (the "staging"); the write then runs in the background and
returns a future that the caller waits on before the next save (PyTorch blog, Pasqualin et al.
2024: a 7B model's checkpoint downtime from 148.8 s to 6.3 s).

- `staging`: training changes its weights in place right after ``async_save`` returns, while the
  write is held back (a gated writer); the checkpoint must hold the values of the save, not the
  new ones. It does with DCP's default stager and the hand `sharded_checkpoint.stage`, which
  copy; it does not with a stager that hands the live tensors to the writer.
- `pauses`: the two pauses, after discarded warm-up repeats, in repeats that alternate which save
  goes first, both saves on one process group; the paired ratios give a median with its interval
  (`labs.measure.intervals`), and `drift` compares the first and last halves of the repeats. On a
  CPU the staging is itself a memory copy, so the ratio says little about a GPU; it is printed,
  never asserted.
"""
import os
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from labs.launcher import launch
from labs import model as tiny
from labs.checkpointing import sharded_checkpoint as sc, training
from labs.measure import intervals

# about 10 MB per rank at 2 ranks: small enough for 9 paired repeats in a few seconds
PAUSE_CFG = dict(vocab_size=256, seq_len=16, n_layer=2, n_head=4, hidden=256)


def _fsdp_state(rank, world_size, cfg):
    """The FSDP2 tiny GPT after one step, as DCP's {"model", "optim"} state of DTensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    net, _, opt, _, loader = training.build("dcp", rank, world_size, cfg, launch.device())
    net(*training.batch(cfg, loader.next(), launch.device())).backward()
    opt.step()
    msd, osd = get_state_dict(net, opt)
    return {"model": msd, "optim": osd}


def _local(state):
    """This rank's pieces of every tensor in ``state``, in a fixed order."""
    out = []
    for _, v in sc._flatten(state):
        v = v.tensor if isinstance(v, sc.Shard) else v
        if isinstance(v, torch.Tensor):
            out.append(v.to_local() if hasattr(v, "to_local") else v)
    return out


def _no_copy(state):
    return state   # the bug: the writer reads the live tensors training is about to change


def _dcp_holds_old(state, root, copying, group):
    """``dcp.async_save`` with a writer held back until training has changed every tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
    from torch.utils._pytree import tree_map

    class GatedWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            gate.wait()        # slow storage: nothing is written before training has moved on
            return super().write_data(plan, planner)

    class NoCopyStager(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict):
            return _no_copy(state_dict)

    gate, before = threading.Event(), [t.clone() for t in _local(state)]
    stager = DefaultStager(StagingOptions(False, False, False, False)) if copying else NoCopyStager()
    future = dcp.async_save(state, storage_writer=GatedWriter(root), async_stager=stager, process_group=group)
    for t in _local(state):
        t.add_(1.0)            # the next optimizer step, in place
    gate.set()
    future.result()
    blank = tree_map(lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v, state)
    dcp.load(blank, checkpoint_id=root, process_group=group)
    for t in _local(state):
        t.sub_(1.0)
    return all(torch.equal(a, b) for a, b in zip(before, _local(blank)))


def _hand_holds_old(rank, root, copying, group):
    """The same with the hand format's `sharded_checkpoint.async_save` and its gate."""
    state = {"w": sc.Shard(torch.arange(8, dtype=torch.float32) + 8 * rank, 8 * rank,
                           (8 * dist.get_world_size(),))}
    before, gate = state["w"].tensor.clone(), threading.Event()
    future = sc.async_save(state, root, group, sc.stage if copying else _no_copy, gate=gate)
    state["w"].tensor.add_(1.0)
    gate.set()
    future.result()
    back = {"w": sc.Shard(torch.zeros(8), 8 * rank, state["w"].shape)}
    sc.load(back, root)
    return torch.equal(back["w"].tensor, before)


@launch.on_cpu(sc.ON_CPU)
def staging(rank, world_size, root, cfg=None):
    """Whether the checkpoint holds the values of the save after training changed them in place
    right after ``async_save`` returned: DCP and the hand format, each with a copying stager and
    with one that does not copy. Every rank must agree; returns this rank's four answers."""
    group = dist.new_group(backend="gloo")       # the writer's collectives, apart from training's
    state = _fsdp_state(rank, world_size, cfg or tiny.GPTConfig())
    out = {}
    for copying in (True, False):
        name = "copy" if copying else "no_copy"
        out[f"dcp_{name}"] = _dcp_holds_old(state, os.path.join(root, f"dcp-{name}"), copying, group)
        out[f"hand_{name}"] = _hand_holds_old(rank, os.path.join(root, f"hand-{name}"), copying, group)
    return out


WARMUP = 2   # repeats of both saves run first and discarded


def order(i):
    """Which save kept repeat ``i`` runs first: sync in even repeats, async in odd ones, so that
    each goes first about half the time; the warm-ups are numbered -WARMUP..-1 and alternate too."""
    return ("async", "sync") if i % 2 else ("sync", "async")


@launch.on_cpu(sc.ON_CPU)
def pauses(rank, world_size, root, repeats=9, cfg=None, warmup=WARMUP):
    """Seconds training stops for ``dcp.save`` and for ``dcp.async_save`` (until it returns: the
    copy to CPU memory), and until the async write is done, on the same FSDP2 state and the same
    gloo process group. The first ``warmup`` repeats run both saves and are discarded; after them,
    which save goes first alternates (`order`), so that neither always runs on the warmer cache or
    the quieter machine. Returns this rank's ``repeats`` kept times of each, in repeat order."""
    import torch.distributed.checkpoint as dcp
    state = _fsdp_state(rank, world_size, cfg or tiny.GPTConfig(**PAUSE_CFG))
    group = dist.new_group(backend="gloo")       # both saves' collectives, apart from training's
    sync, paused, total = [], [], []

    def save_sync(i):
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=os.path.join(root, f"sync-{i}"), process_group=group)
        sync.append(time.perf_counter() - t0)

    def save_async(i):
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=os.path.join(root, f"async-{i}"), process_group=group)
        paused.append(time.perf_counter() - t0)
        future.result()              # the caller waits for the write: no training step runs beside it
        total.append(time.perf_counter() - t0)

    for i in range(-warmup, repeats):
        for name in order(i):
            {"sync": save_sync, "async": save_async}[name](i)
    return {"sync_samples_s": sync[warmup:], "async_pause_samples_s": paused[warmup:],
            "async_total_samples_s": total[warmup:], "warmup": warmup,
            "state_bytes_per_rank": sum(t.numel() * t.element_size() for t in _local(state))}


def drift(samples):
    """(median of the first half, median of the last half) of ``samples`` in repeat order; with an
    odd count the middle one is in neither. Times that fall or rise from one half to the other were
    not stationary: their two medians do not describe one regime, where a paired ratio may."""
    half = len(samples) // 2
    if half < 1:
        raise ValueError(f"drift needs at least 2 samples, got {len(samples)}.")
    return statistics.median(samples[:half]), statistics.median(samples[-half:])


def measure_staging(world_size=2, timeout=120.0):
    """`staging` on ``world_size`` ranks: {check: True if every rank's checkpoint held the old values}."""
    with tempfile.TemporaryDirectory(prefix="ckpt-stage-") as root:
        results = launch.spawn(staging, world_size, root, timeout=timeout)
    return {k: all(r[k] for r in results) for k in results[0]}


def measure_pauses(world_size=2, repeats=9, timeout=300.0):
    """`pauses` on ``world_size`` ranks. Each repeat counts its slowest rank (the job waits for
    it): ``*_samples_s`` are those per-repeat maxima, and each pause is their median, so a
    median and the range of its samples come from the same numbers.

    The two saves of a repeat form a pair, and `labs.measure.intervals` turns the paired ratios
    into a median with its interval: ``pause_ratio``, async pause / sync pause, and
    ``written_ratio``, async written and done / sync; each ``verdict`` names the shorter only where
    its interval excludes 1. The median of the ratios is not the ratio of the two medians. Each
    ``*_drift`` is `drift` of the sync pauses, the async pauses or a ratio: the medians of the
    first and last halves of the repeats."""
    intervals.median_ranks(repeats)                    # refuses too few repeats before spawning
    with tempfile.TemporaryDirectory(prefix="ckpt-pause-") as root:
        results = launch.spawn(pauses, world_size, root, repeats, timeout=timeout)
    out = {k: [max(xs) for xs in zip(*(r[k] for r in results))]
           for k in results[0] if k.endswith("_samples_s")}
    out.update(repeats=repeats, warmup=results[0]["warmup"],
               state_bytes_per_rank=max(r["state_bytes_per_rank"] for r in results))
    for pause, samples in (("sync_pause_s", "sync_samples_s"), ("async_pause_s", "async_pause_samples_s"),
                           ("async_total_s", "async_total_samples_s")):
        out[pause] = statistics.median(out[samples])
    cores = intervals.cores()
    for name, asynchronous in (("pause_ratio", "async_pause_samples_s"),
                               ("written_ratio", "async_total_samples_s")):
        iv = intervals.ratio_interval(out[asynchronous], out["sync_samples_s"])
        iv["verdict"] = intervals.verdict(iv, "dcp.async_save", "dcp.save", world_size, cores)
        out[name] = iv
        out[f"{name}_drift"] = drift([a / b for a, b in zip(out[asynchronous], out["sync_samples_s"])])
    out["sync_drift_s"] = drift(out["sync_samples_s"])
    out["async_pause_drift_s"] = drift(out["async_pause_samples_s"])
    return out
