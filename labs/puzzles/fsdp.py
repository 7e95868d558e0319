"""Chapter 16, puzzle 4 (chapter 3 teaches it): an FSDP unit: gather before forward, free after it,
reduce-scatter the gradients.

The reader writes ``fsdp_unit(module)``: shard the parameters the module owns (an ``nn.Linear`` in the
grader; Psi_u elements flattened in ``module.parameters()`` order, a multiple of N) so that rank r keeps
elements [r Psi_u/N, (r+1) Psi_u/N), and return this rank's shard as a list of tensors whose ``.grad``
backward fills. The full weights live in one buffer that holds memory only while the unit works: all-
gathered (``comm.all_gather``) before forward and freed after it (``untyped_storage().resize_(0)``, since
autograd keeps a reference), gathered again before backward (a hook on the output's gradient), and freed
once the unit's gradients are reduce-scattered (``comm.reduce_scatter``, then / N) into the shard. The
reference is chapter 3's `labs.zero.fsdp.HandFSDP` with the module as its one unit (`reference`).

The grader wraps the two linear layers of a tiny MLP as two units and runs one forward and backward on
2 ranks, each with its own batch. Checked on every rank:
- each shard's gradient against one process's average gradient, same slice: the same float32 ops
  in the same order, then a sum of N = 2 values, so bitwise is expected; the grader allows the bound
  of a sum of N floats, (N - 1) u sum |g_r| (Higham 2002, section 4.2); a NaN is named (`grader.nan_in`);
- the peak during forward (`labs.measure.memory.PeakMemory`, storages counted as they live): above
  the shards, at most everything that may be alive at once: the largest unit's full weights,
  4 Psi_u, the hand all-gather's message buffer (4 Psi_u/N) and what the forward itself holds,
  measured as one process's peak above its weights for the same forward. A unit that never frees
  holds the other unit's weights too, 4 Psi_u' more, which exceeds the message buffer's allowance
  by 4 Psi_u' - 4 Psi_u/N (256 bytes here); storages are counted, not sampled from the allocator,
  so that margin does not move from run to run;
- what is alive after backward (`PeakMemory` around it, its end), besides the shards, their
  gradients, the batch and the loss: at most a message buffer (4 Psi_u/N) and what one process's
  backward leaves besides its weights and gradients (measured: none). A unit that keeps its full
  weights gathered after its reduce-scatter holds 4 Psi_u per unit more, and is named;
- the bytes: per unit an all-gather before forward and another before backward, a reduce-scatter
  after backward, each (N-1)/N 4 Psi_u, counted as chapter 2's hand rings (`hand_collectives`).
"""
import copy

import torch

from labs.data_parallel.hand_ring import hand_collectives
from labs.measure import comm, memory
from labs.puzzles import grader
from labs.zero.fsdp import HandFSDP

IN, HID, BATCH = 8, 16, 4
UNITS = (0, 2)  # the two linear layers of the MLP
U = 2.0**-24
HINT_HANG = ("every rank gathers and reduce-scatters the same units in the same order: forward unit 0 "
             "then 1, backward unit 1 then 0.")


def reference(module):
    """Chapter 3's FSDP with the module as its only unit: this rank's pieces of the flat shard."""
    return list(HandFSDP(module).model.parameters())


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, IN))


def batch(rank):
    g = torch.Generator().manual_seed(30 + rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, IN, generator=g)


def check(rank, world_size, fn):
    """On one rank: wrap both units, then a forward (its peak measured) and a backward, bytes counted."""
    model = copy.deepcopy(net())
    x, y = batch(rank)
    with hand_collectives():
        shards = [list(fn(model[i])) for i in UNITS]
        with comm.counting() as fwd, memory.PeakMemory(model, shards, x, y) as mem:
            loss = torch.nn.functional.mse_loss(model(x), y)
        with comm.counting() as bwd, memory.PeakMemory(model, shards, x, y, loss) as after:
            loss.backward()
    mine = [t for s in shards for t in s]
    return {"after": after.end_bytes - memory.storage_bytes(mine + [t.grad for t in mine] + [x, y, loss]),
            "grads": [[None if t.grad is None else t.grad.reshape(-1).clone() for t in s] for s in shards],
            "sizes": [[t.numel() for t in s] for s in shards], "shard_bytes": memory.storage_bytes(
                [t for s in shards for t in s]), "peak": mem.peak_bytes,
            "above": mem.peak_bytes - memory.storage_bytes([t for s in shards for t in s] + [x, y]),
            "fwd_bytes": fwd.bytes_sent, "bwd_bytes": bwd.bytes_sent,
            "bwd_ops": {op: e["calls"] for op, e in bwd.ops.items() if e["calls"]}}


def one_process(world_size):
    """The average gradient of each unit (flat), the bound of each element, the forward's own peak, and
    what one process's backward leaves alive besides weights, gradients, batch and loss."""
    grads, size = [], []
    for r in range(world_size):
        model = net()
        x, y = batch(r)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([torch.cat([p.grad.reshape(-1) for p in model[i].parameters()]) for i in UNITS])
    avg = [sum(g[u] for g in grads) / world_size for u in range(len(UNITS))]
    size = [(world_size - 1) * U * sum(g[u].abs() for g in grads) / world_size for u in range(len(UNITS))]
    model = net()
    x, y = batch(0)
    with memory.PeakMemory(model, x, y) as mem:
        loss = torch.nn.functional.mse_loss(model(x), y)
    with memory.PeakMemory(model, x, y, loss) as after:
        loss.backward()
    params = list(model.parameters())
    left = after.end_bytes - memory.storage_bytes(params + [p.grad for p in params] + [x, y, loss])
    return avg, size, mem.peak_bytes - mem.baseline_bytes, left


def grade(fn, world_size=2, deadline=15.0):
    results = grader.run(check, fn, world_size, deadline, HINT_HANG)
    if isinstance(results, grader.Grade):
        if "storage of size 0" in results.lines[0]:
            results.hint = ("backward needs the full weights that forward used and you freed: gather them "
                            "again before the unit's backward (a hook on the output's gradient), and free "
                            "them after the reduce-scatter.")
        return results
    avg, bound, act, left = one_process(world_size)
    psi = [a.numel() for a in avg]
    for r, res in enumerate(results):
        for u, (grads, sizes) in enumerate(zip(res["grads"], res["sizes"])):
            k = psi[u] // world_size
            if sum(sizes) != k or any(g is None for g in grads):
                return grader.Grade(False, [
                    f"rank {r}'s unit {u} returned {sum(sizes)} elements"
                    f"{' without a gradient' if sum(sizes) == k else ''}; its shard is Psi_u/N = {k} "
                    f"(Psi_u = {psi[u]})"],
                    "flatten the unit's parameters, keep slice r of N as a tensor that requires grad, "
                    "return it, and put the reduce-scattered gradient / N in its .grad.")
            got, want, b = torch.cat(grads), avg[u][r * k:(r + 1) * k], bound[u][r * k:(r + 1) * k]
            nan = grader.nan_in(r, f"unit {u} gradient shard", got)
            if nan:
                return nan
            err = (got - want).abs()
            if grader.exceeds(err, b).any():
                i = grader.worst(err, b)
                hint = (f"the gradient is N = {world_size} times the average: divide by N after the "
                        "reduce-scatter." if torch.allclose(got, world_size * want, atol=1e-7) else
                        "reduce-scatter the full gradient (every rank's, in the same flat order) and keep "
                        "slice r.")
                return grader.Grade(False, [
                    f"rank {r}'s unit {u} gradient differs from one process at shard element {i}: "
                    f"{got[i].item():.6g}, the average says {want[i].item():.6g} "
                    f"(off by {err[i].item():.2g})"],
                    hint)
    allowed = max(psi) * 4 + max(psi) * 4 // world_size + act
    for r, res in enumerate(results):
        above = res["above"]
        if above > allowed:
            return grader.Grade(False, [
                f"rank {r} held {res['peak']:,} bytes at its peak in forward: {above:,} above its "
                f"shards and its batch; one unit's full weights (4 Psi_u = {4 * max(psi):,}) plus the "
                f"forward's own {act:,} and a message buffer ({4 * max(psi) // world_size}) allow "
                f"{allowed:,}: {above - allowed:,} bytes too many"],
                "free each unit's full weights right after its forward (untyped_storage().resize_(0)): "
                "FSDP holds one unit's weights at a time, not the whole model's.")
    buffer = 4 * max(psi) // world_size
    for r, res in enumerate(results):
        if res["after"] > left + buffer:
            kept = [u for u in range(len(psi)) if 4 * psi[u] <= res["after"]]
            units = (f"; the units' full weights, 4 Psi_u = {' + '.join(f'{4 * psi[u]:,}' for u in kept)}, "
                     "are still gathered" if sum(4 * psi[u] for u in kept) == res["after"] else "")
            return grader.Grade(False, [
                f"rank {r} holds {res['after']:,} bytes after backward besides its shards, their gradients "
                f"and its batch{units}; a message buffer ({buffer}) and what one process's backward leaves "
                f"({left}) allow {left + buffer:,}: {res['after'] - left - buffer:,} bytes too many"],
                "free each unit's full weights once its gradients are reduce-scattered "
                "(untyped_storage().resize_(0)): after backward FSDP keeps only the shard and its gradient.")
    gather = [4 * p * (world_size - 1) // world_size for p in psi]
    want_f, want_b = sum(gather), 2 * sum(gather)
    for r, res in enumerate(results):
        for phase, got, want in (("forward", res["fwd_bytes"], want_f),
                                 ("backward", res["bwd_bytes"], want_b)):
            if got != want:
                more = got - want
                ops = ", ".join(f"{n} {op}" for op, n in sorted(res["bwd_ops"].items()))
                return grader.Grade(False, [
                    f"rank {r} sent {got:,} bytes in {phase}"
                    + (f" ({ops})" if phase == "backward" else "")
                    + f"; FSDP sends {want:,} there: {abs(more):,} bytes "
                    + ("too many" if more > 0 else "too few")],
                    _hint_bytes(phase, more))
    return grader.Grade(True, [
        f"FSDP, 2 units (Psi_u = {psi[0]}, {psi[1]} fp32) on {world_size} ranks, one forward and backward",
        "each shard's gradient: one process's average, same slice, on every rank",
        f"peak in forward above the shards: {', '.join(str(res['above']) for res in results)} "
        f"bytes, within {allowed:,} = one unit's full weights 4 Psi_u ({4 * max(psi):,}) + a message "
        f"buffer 4 Psi_u/N ({4 * max(psi) // world_size}) + the forward's own peak in one process "
        f"({act:,})",
        f"after backward, besides the shards and their gradients: "
        f"{', '.join(str(res['after']) for res in results)} bytes (the full weights freed)",
        f"bytes per rank: forward {want_f:,} (an all-gather per unit), backward {want_b:,} (an all-gather "
        "and a reduce-scatter per unit), each (N-1)/N 4 Psi_u"])


def _hint_bytes(phase, more):
    if phase == "backward" and more > 0:
        return ("reduce-scatter the gradients ((N-1)/N of the buffer: each rank needs the sum of its own "
                "slice only) instead of all-reducing them (2(N-1)/N).")
    if phase == "backward":
        return ("gather the weights again before backward (they were freed after forward), then "
                "reduce-scatter.")
    return "all-gather each unit's full weights once before its forward, with comm.all_gather."
