"""Chapter 16, puzzle 2 (chapter 2 teaches it): a DDP gradient hook with buckets and ``no_sync``.

The reader writes ``ddp(model, bucket_cap_bytes)``: return a wrapper with a ``no_sync()`` context
manager. While ``no_sync`` is on, backward leaves each rank's gradients alone (they accumulate in
``.grad``); otherwise, as backward produces the gradients (``register_post_accumulate_grad_hook``),
they are packed into buckets of about ``bucket_cap_bytes`` in reverse parameter order, and a bucket
whose gradients are all ready is all-reduced with ``comm.all_reduce`` and divided by N; when
backward ends, ``.grad`` holds the average over ranks. The reference is chapter 2's
`labs.data_parallel.hand_ddp.HandDDP`.

The grader's step is one accumulation of 2 micro-batches: the first under ``no_sync``, the second
synced. Checked on every rank:
- each gradient against one process that averages the ranks' accumulated gradients. Where the
  same float32 ops run in the same order (the reference: autograd's accumulation, then a sum of
  N = 2 values, which has one order, and an exact division by 2) it is bitwise; a hook that sums
  the 2N micro-batch terms in another order may differ by the bound of a sum of 2N floats,
  (2N - 1) u sum |terms| (Higham 2002, section 4.2);
- no byte sent inside ``no_sync``;
- the synced backward's bytes against a ring all-reduce of every gradient once: the all-reduces run
  as chapter 2's hand rings (`hand_collectives`), 2(N-1)/N 4 Psi per rank whatever the buckets;
- the buckets: at most as many all-reduces as buckets of ``bucket_cap_bytes`` (one per gradient
  pays the latency term once per parameter).
"""
import copy

import torch

from labs.data_parallel.hand_ddp import HandDDP
from labs.data_parallel.hand_ring import hand_collectives
from labs.formulas import costs
from labs.measure import comm
from labs.puzzles import grader

IN, HID, OUT, BATCH, CAP = 4, 8, 2, 3, 64
U = 2.0**-24
HINT_HANG = ("every rank makes the same all-reduces in the same order: launch the buckets in bucket order, "
             "and skip them on every rank under no_sync.")
reference = HandDDP


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def batch(rank, micro):
    g = torch.Generator().manual_seed(10 * rank + micro)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def loss(model, rank, micro):
    x, y = batch(rank, micro)
    return torch.nn.functional.mse_loss(model(x), y)


def check(rank, world_size, fn):
    """On one rank: micro-batch 0 under no_sync, micro-batch 1 synced, bytes counted for each."""
    model = copy.deepcopy(net())
    with hand_collectives():
        wrapped = fn(model, CAP)
        with comm.counting() as quiet:
            with wrapped.no_sync():
                loss(model, rank, 0).backward()
        with comm.counting() as synced:
            loss(model, rank, 1).backward()
    return {"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "quiet_bytes": quiet.bytes_sent, "bytes": synced.bytes_sent,
            "calls": synced.ops.get("all_reduce", {}).get("calls", 0)}


def one_process(world_size):
    """Each rank's accumulated gradients, computed here, and their average."""
    local, size = [], {}
    for r in range(world_size):
        model = net()
        for micro in range(2):
            before = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for n, p in model.named_parameters()}
            loss(model, r, micro).backward()
            for n, p in model.named_parameters():
                size[n] = size.get(n, 0) + (p.grad - before[n]).abs()
        local.append({n: p.grad for n, p in model.named_parameters()})
    avg = {n: sum(g[n] for g in local) / world_size for n in local[0]}
    bound = {n: (2 * world_size - 1) * U * s / world_size for n, s in size.items()}
    return local, avg, bound


def grade(fn, world_size=2, deadline=15.0):
    results = grader.run(check, fn, world_size, deadline, HINT_HANG)
    if isinstance(results, grader.Grade):
        return results
    local, avg, bound = one_process(world_size)
    exact = True
    for r, res in enumerate(results):
        for name, want in avg.items():
            got = res["grads"][name]
            err = (got - want).abs()
            exact = exact and bool((err == 0).all())
            if (err > bound[name]).any():
                i = int((err - bound[name]).argmax())
                return grader.Grade(False, [
                    f"rank {r}'s gradient of {name} differs from one process at element {i}: "
                    f"{got.reshape(-1)[i].item():.6g}, the average over ranks is "
                    f"{want.reshape(-1)[i].item():.6g} (off by {err.reshape(-1)[i].item():.2g})"],
                    _hint_grad(got, want, local[r][name], world_size))
    m = 4 * sum(g.numel() for g in avg.values())
    want_bytes = costs.sent("all_reduce", m, world_size)
    for r, res in enumerate(results):
        if res["quiet_bytes"]:
            return grader.Grade(False, [
                f"rank {r} sent {res['quiet_bytes']:,} bytes inside no_sync (micro-batch 0), where it "
                f"should send none: {res['quiet_bytes']:,} bytes too many"],
                "under no_sync the hook must return without communicating; the gradients add up in "
                ".grad, and the synced micro-batch's all-reduce averages the sum once.")
        if res["bytes"] != want_bytes:
            more = res["bytes"] - want_bytes
            return grader.Grade(False, [
                f"rank {r} sent {res['bytes']:,} bytes in the synced backward ({res['calls']} all-reduces); "
                f"one ring all-reduce of every gradient, 2(N-1)/N 4 Psi, is {want_bytes:,}: "
                f"{abs(more):,} bytes {'too many' if more > 0 else 'too few'}"],
                "put each gradient in exactly one bucket and all-reduce each bucket once, with "
                "comm.all_reduce.")
    buckets = len(HandDDP._make_buckets(list(net().parameters()), CAP))
    for r, res in enumerate(results):
        if res["calls"] > buckets:
            return grader.Grade(False, [
                f"rank {r} made {res['calls']} all-reduces; {CAP}-byte buckets need {buckets}"],
                "pack the gradients into buckets of about bucket_cap_bytes: each all-reduce pays the "
                "latency term once.")
    how = "bitwise" if exact else "within (2N-1) u sum|terms|"
    return grader.Grade(True, [
        f"bucketed DDP on {world_size} ranks, Psi = {m // 4} fp32 gradients, {CAP}-byte buckets, "
        "2 micro-batches, the first under no_sync",
        f"gradients: the average over ranks of the accumulated gradients ({how}) on every rank",
        f"bytes: none inside no_sync; 2(N-1)/N 4 Psi = {want_bytes:,} per rank in the synced backward, "
        f"in {results[0]['calls']} all-reduce(s), counted message by message"])


def _hint_grad(got, want, mine, n):
    got, want, mine = got.double(), want.double(), mine.double()
    if torch.allclose(got, n * want, rtol=1e-5, atol=1e-7):
        return f"the gradient is N = {n} times the average: divide the bucket by N (summed, not averaged)."
    if torch.allclose(got, mine, rtol=1e-5, atol=1e-7):
        return ("this gradient is the rank's own, never averaged over the ranks: hook every parameter "
                "(register_post_accumulate_grad_hook) and all-reduce each bucket once all its gradients "
                "are ready.")
    return ("a bucket's all-reduce must see every one of its gradients, accumulated over the micro-batches: "
            "launch it when the last of them is ready, and copy the average back into each .grad.")
