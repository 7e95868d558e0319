"""Chapter 9: gradient accumulation, what it sends and what it holds, and where clipping acts.

- `accumulation_vs_full_batch`: micro-batches of unequal token counts against the full batch
  (chapter 2's token-weighted loss, `labs.data_parallel.loss_reduction`).
- `no_sync_counts`: chapter 2's hand DDP with and without ``no_sync``: all-reduce calls (one per
  gradient bucket) and the payload bytes handed to them, per optimizer step.
- `fsdp_no_sync`: FSDP2 (``set_requires_gradient_sync``) and chapter 3's hand FSDP (the same switch)
  accumulating A micro-batches with the reduce-scatter in every micro-batch or only in the last:
  counted messages of the hand rings per micro-batch and per step, the live bytes held between
  micro-batches and the step's peak (`memory.PeakMemory`), the result against one process.
- `clipping`: gradient clipping and the loss scale under accumulation (`torch.amp.GradScaler`,
  ``clip_grad_norm_``): clip once, after the last micro-batch and after unscaling, and the update
  equals the full batch's; clip every micro-batch, or before unscaling, and it does not.

    python -m labs.recompute.accumulation --world-size 2 --json
"""
import torch
import torch.distributed as dist

from labs import model as tiny
from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.data_parallel import ddp, hand_ring, loss_reduction
from labs.launcher import launch
from labs.measure import comm, memory
from labs.zero import fsdp


def accumulation_vs_full_batch(accumulation=4, micro_batch=2, seed=0):
    """k micro-batches of unequal token counts in one process against the full batch at once:
    chapter 2's `loss_reduction.compare` at world size 1. right_err (sum of token losses over the
    global count n_tok) is rounding; naive_err (each micro-batch's own mean / k) is not."""
    return loss_reduction.compare(1, accumulation, micro_batch, seed)


def _no_sync_counts(rank, world_size, accumulation, steps):
    """All-reduces of chapter 2's hand DDP with and without ``no_sync``, and without accumulation."""
    out = {}
    for name, acc, use in (("no_accumulation", 1, True), ("no_sync", accumulation, True),
                           ("sync_every_micro_batch", accumulation, False)):
        r = ddp.run(rank, world_size, steps=steps, accumulation=acc, use_no_sync=use)
        out[name] = {"allreduce_calls": r["allreduce_calls"], "buckets": r["buckets"],
                     "payload_bytes": r["allreduce_payload_bytes"],
                     "calls_per_step": r["allreduce_calls"] // steps,
                     "payload_bytes_per_step": r["allreduce_payload_bytes"] // steps,
                     "max_param_diff_vs_single_process": r["max_param_diff_vs_single_process"]}
    return out


def no_sync_counts(world_size=2, accumulation=4, steps=2, timeout=120.0):
    """All-reduce calls and their payload bytes (the bytes of the tensors handed to each all-reduce,
    `labs.measure.comm`) per optimizer step, through `ddp.run`."""
    return launch.spawn(_no_sync_counts, world_size, accumulation, steps, timeout=timeout)[0]


# --- sharded data parallelism: the reduce-scatter per micro-batch, or once ----------------------

def _micro_batches(cfg, rank, accumulation, batch):
    return [tiny.synthetic_batch(cfg, batch, seed=100 * rank + k) for k in range(accumulation)]


def _wrap(kind, net, world_size):
    """Shard ``net`` by blocks with the hand FSDP or FSDP2 (its collectives through labs.measure.comm)."""
    if kind == "hand":
        return fsdp.HandFSDP(net, units=list(net.blocks))
    mesh = device_mesh(ParallelDims(dp=world_size), "cpu")["dp"]
    return fsdp.fully_shard_units(net, list(net.blocks), mesh, hand_comm=True)


def _one_step(kind, sync_each, rank, world_size, cfg, accumulation, batch, lr):
    """One optimizer step over ``accumulation`` micro-batches; the reduce-scatter in every micro-batch
    (``sync_each``) or only in the last. Counted messages per micro-batch, live bytes after each
    micro-batch's backward and the step's peak, both above the sharded model and optimizer."""
    net = tiny.build(cfg, seed=0)
    wrapped = _wrap(kind, net, world_size)
    opt = torch.optim.SGD(net.parameters(), lr=lr)   # SGD: a gradient error passes through unamplified
    per_micro, held = [], []
    with hand_ring.hand_collectives(), memory.PeakMemory(net, opt) as mem:
        for k, (x, y) in enumerate(_micro_batches(cfg, rank, accumulation, batch)):
            wrapped.set_requires_gradient_sync(sync_each or k == accumulation - 1)
            with comm.counting() as tally:
                (net(x, y) / accumulation).backward()
            per_micro.append({op: {"calls": e["calls"], "bytes_sent": e["bytes_sent"]}
                              for op, e in tally.as_dict()["ops"].items()})
            held.append(mem.net)
        with comm.counting() as step_tally:
            opt.step()
        peak = mem.peak_net
    full = fsdp.HandFSDP.full_parameters(wrapped) if kind == "hand" else \
        {n: p.full_tensor() for n, p in net.named_parameters()}
    return {"per_micro_batch": per_micro,
            "bytes_per_step": sum(e["bytes_sent"] for m in per_micro for e in m.values())
            + step_tally.bytes_sent, "held_after_micro_batch": held, "peak_bytes": peak,
            "params": {n: t.detach().clone() for n, t in full.items()}}


def _reference(cfg, world_size, accumulation, batch, lr):
    """One process, every rank's micro-batches at once, one SGD step."""
    net = tiny.build(cfg, seed=0)
    data = [xy for r in range(world_size) for xy in _micro_batches(cfg, r, accumulation, batch)]
    net(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])).backward()
    torch.optim.SGD(net.parameters(), lr=lr).step()
    return {n: p.detach() for n, p in net.named_parameters()}


def _fsdp_no_sync(rank, world_size, accumulation, batch, lr):
    cfg = tiny.GPTConfig()
    ref = _reference(cfg, world_size, accumulation, batch, lr)
    out = {"unsharded_grad_bytes": sum(p.numel() * p.element_size() for p in ref.values())}
    for kind in ("hand", "fsdp2"):
        for sync_each in (True, False):
            r = _one_step(kind, sync_each, rank, world_size, cfg, accumulation, batch, lr)
            r["max_param_diff_vs_one_process"] = max((r["params"][n] - p).abs().max().item()
                                                     for n, p in ref.items())
            del r["params"]
            out[f"{kind}, {'sync every micro-batch' if sync_each else 'no sync until the last'}"] = r
    dist.barrier()
    return out


def fsdp_no_sync(world_size=2, accumulation=4, batch=2, lr=0.1, timeout=180.0):
    """The hand FSDP and FSDP2 with the reduce-scatter in every micro-batch or only in the last, on
    ``world_size`` ranks: per run, counted messages per micro-batch (all-gathers and reduce-scatters
    of chapter 2's hand rings), bytes sent per step, live bytes after each micro-batch, the step's
    peak, and the largest parameter difference from one process. Rank 0's view, and every rank's."""
    results = launch.spawn(_fsdp_no_sync, world_size, accumulation, batch, lr, timeout=timeout)
    return {"world_size": world_size, "accumulation": accumulation, "ranks": results, **results[0]}


def _sync_switches(rank, world_size, accumulation, batch, lr):
    return {"ddp": _no_sync_counts(rank, world_size, accumulation, 1),
            "fsdp": _fsdp_no_sync(rank, world_size, accumulation, batch, lr)}


def sync_switches(world_size=2, accumulation=4, batch=2, lr=0.1, timeout=240.0):
    """`no_sync_counts` (one optimizer step) and `fsdp_no_sync` in one spawn: the process start, the
    slowest part at this size, is paid once for both."""
    results = launch.spawn(_sync_switches, world_size, accumulation, batch, lr, timeout=timeout)
    fsdp_runs = [r["fsdp"] for r in results]
    return {"ddp": results[0]["ddp"],
            "fsdp": {"world_size": world_size, "accumulation": accumulation, "ranks": fsdp_runs,
                     **fsdp_runs[0]}}


# --- clipping and the loss scale under accumulation ---------------------------------------------

def _clipped_update(mode, cfg, data, max_norm, scale, lr):
    """One SGD step over the micro-batches ``data`` with a GradScaler at ``scale`` and clipping:
    "once" (accumulate, unscale, clip, step: the order torch's AMP documentation gives), "per
    micro-batch" (clip each micro-batch's own gradient as it arrives), "before unscaling" (clip the
    scaled sum). Returns the update and the gradient norm the clip saw."""
    net = tiny.build(cfg, seed=0)
    before = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    acc = [torch.zeros_like(p) for p in net.parameters()]
    seen = []
    for x, y in data:
        opt.zero_grad()
        scaler.scale(net(x, y) / len(data)).backward()
        if mode == "per micro-batch":     # each micro-batch clipped on its own, then summed
            grads = [p.grad / scale for p in net.parameters()]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            seen.append(norm.item())
            grads = [g * min(1.0, max_norm / (norm.item() + 1e-6)) for g in grads]
            acc = [a + g * scale for a, g in zip(acc, grads)]
        else:
            acc = [a + p.grad for a, p in zip(acc, net.parameters())]
    for p, a in zip(net.parameters(), acc):
        p.grad = a
    if mode == "before unscaling":
        seen.append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm).item())
    scaler.unscale_(opt)
    if mode == "once":
        seen.append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm).item())
    scaler.step(opt)
    return [p.detach() - b for p, b in zip(net.parameters(), before)], seen


def clipping(accumulation=4, batch=2, clip_fraction=0.25, scale=2.0 ** 10, lr=0.1, seed=0):
    """The full batch's clipped update against three ways of clipping under accumulation.

    The reference: one process, the whole batch, clip to ``clip_fraction`` of its gradient norm, SGD
    step. At the default quarter every micro-batch's own norm exceeds the threshold, so clipping each
    micro-batch (about sqrt(m) - 1 off) and a branch that never clips ((1 - c_f) / c_f off) differ.
    Returns per mode the relative difference of its update from the reference's and the norms its
    clip saw."""
    cfg = tiny.GPTConfig()
    data = [tiny.synthetic_batch(cfg, batch, seed=seed + k) for k in range(accumulation)]
    net = tiny.build(cfg, seed=0)
    net(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])).backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), float("inf")).item()
    max_norm = clip_fraction * norm
    before = [p.detach().clone() for p in tiny.build(cfg, seed=0).parameters()]
    torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    torch.optim.SGD(net.parameters(), lr=lr).step()
    ref = [p.detach() - b for p, b in zip(net.parameters(), before)]
    size = torch.linalg.vector_norm(torch.cat([r.flatten() for r in ref]))
    out = {"full_batch_norm": norm, "max_norm": max_norm, "scale": scale, "modes": {}}
    for mode in ("once", "per micro-batch", "before unscaling"):
        update, seen = _clipped_update(mode, cfg, data, max_norm, scale, lr)
        diff = torch.linalg.vector_norm(torch.cat([(u - r).flatten() for u, r in zip(update, ref)]))
        out["modes"][mode] = {"relative_difference": (diff / size).item(), "norms_seen": seen}
    return out


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Gradient accumulation under FSDP: the reduce-scatter per micro-batch or once, "
                   "bytes and peak.")
    p.add_argument("--accumulation", type=cli.at_most(16, "micro-batches per step"), default=4)
    args = cli.parse(p, argv)
    r = fsdp_no_sync(args.world_size or 2, args.accumulation, timeout=args.timeout)
    del r["ranks"]
    cli.report(r, args,
               "\n".join(f"{k}: {v['bytes_per_step']} bytes sent per step (counted), peak {v['peak_bytes']} B"
                                  for k, v in r.items() if isinstance(v, dict)))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
