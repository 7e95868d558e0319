"""Chapter 16, puzzle 2 (chapter 2 teaches it): a DDP gradient hook with buckets and ``no_sync``.

The reader writes ``ddp(model, bucket_cap_bytes)``: return a wrapper with a ``no_sync()`` context
manager. While ``no_sync`` is on, backward leaves each rank's gradients alone (they accumulate in
``.grad``); otherwise, as backward produces the gradients (``register_post_accumulate_grad_hook``),
they are packed into buckets of about ``bucket_cap_bytes`` in reverse parameter order, and a bucket
whose gradients are all ready is all-reduced with ``comm.all_reduce`` and divided by N; when
backward ends, ``.grad`` holds the average over ranks. The reference is chapter 2's
`labs.data_parallel.hand_ddp.HandDDP`.

The grader runs three backwards on one wrapper: an accumulation of 2 micro-batches, the first under
``no_sync``, the second synced; then, the gradients dropped (``p.grad = None``), a second synced
backward of a third micro-batch. A hook whose per-bucket counters are not re-armed after each
all-reduce is right once and silent the second time. Checked on every rank, for both synced backwards:
- each gradient against one process that averages the ranks' accumulated gradients. Where the
  same float32 ops run in the same order (the reference: autograd's accumulation, then a sum of
  N = 2 values, which has one order, and an exact division by 2) it is bitwise; a hook that sums
  the 2N micro-batch terms in another order may differ by the bound of a sum of 2N floats,
  (2N - 1) u sum |terms| (Higham 2002, section 4.2); a NaN is named as a NaN (`grader.nan_in`);
- no byte sent inside ``no_sync``;
- each synced backward's bytes against a ring all-reduce of every gradient once: the all-reduces run
  as chapter 2's hand rings (`hand_collectives`), 2(N-1)/N 4 Psi per rank when N divides every
  bucket (true here: N = 2 and even bucket sizes); otherwise each bucket's chunks round apart;
- the buckets: exactly as many all-reduces as the cap implies, filling buckets in reverse parameter
  order and closing one once it holds ``bucket_cap_bytes`` or more (`HandDDP._make_buckets`, DDP's
  rule); one per gradient pays the latency term once per parameter, one for everything overlaps
  nothing;
- the overlap: the grader's own hook, registered before the reader's, notes how many all-reduces
  had started when each gradient became ready; the first bucket's must start before the last
  gradient is ready, or no communication overlaps backward.
"""
import copy

import torch

from labs.data_parallel.hand_ddp import HandDDP
from labs.data_parallel.hand_ring import hand_collectives
from labs.formulas import costs
from labs.measure import comm
from labs.puzzles import grader

IN, HID, OUT, BATCH, CAP = 4, 6, 2, 3, 64  # Psi = 44: not ZeRO-1's 58, so no number is shared
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
    """On one rank: micro-batch 0 under no_sync, micro-batch 1 synced, then the gradients dropped and
    micro-batch 2 synced; gradients and bytes of each synced backward."""
    model = copy.deepcopy(net())
    tally, ready = [], []  # all-reduces started when each gradient was ready, in the first synced backward
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: ready.append(
            (name, tally[0].calls("all_reduce"))) if len(tally) == 1 else None)
    out = {"ready": ready, "steps": []}
    with hand_collectives():
        wrapped = fn(model, CAP)
        with comm.counting() as quiet:
            with wrapped.no_sync():
                loss(model, rank, 0).backward()
        out["quiet_bytes"] = quiet.bytes_sent
        for micro in (1, 2):
            with comm.counting() as synced:
                tally.append(synced)
                loss(model, rank, micro).backward()
            out["steps"].append({"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                                 "bytes": synced.bytes_sent, "calls": synced.calls("all_reduce")})
            for p in model.parameters():
                p.grad = None
    return out


def one_process(world_size, micros=(0, 1)):
    """Each rank's gradients accumulated over ``micros``, computed here, and their average."""
    local, size = [], {}
    for r in range(world_size):
        model = net()
        for micro in micros:
            before = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for n, p in model.named_parameters()}
            loss(model, r, micro).backward()
            for n, p in model.named_parameters():
                size[n] = size.get(n, 0) + (p.grad - before[n]).abs()
        local.append({n: p.grad for n, p in model.named_parameters()})
    avg = {n: sum(g[n] for g in local) / world_size for n in local[0]}
    bound = {n: (len(micros) * world_size - 1) * U * s / world_size for n, s in size.items()}
    return local, avg, bound


def grade(fn, world_size=2, deadline=15.0):
    results = grader.run(check, fn, world_size, deadline, HINT_HANG)
    if isinstance(results, grader.Grade):
        return results
    exact = True
    for step, micros in enumerate(((0, 1), (2,))):
        local, avg, bound = one_process(world_size, micros)
        when = " after the second synced backward (micro-batch 2, .grad dropped before it)" if step else ""
        for r, res in enumerate(results):
            for name, want in avg.items():
                got = res["steps"][step]["grads"][name]
                nan = grader.nan_in(r, f"gradient of {name}{when}", got)
                if nan:
                    return nan
                err = (got - want).abs()
                exact = exact and bool((err == 0).all())
                if grader.exceeds(err, bound[name]).any():
                    i = grader.worst(err, bound[name])
                    return grader.Grade(False, [
                        f"rank {r}'s gradient of {name}{when} differs from one process at element {i}: "
                        f"{got.reshape(-1)[i].item():.6g}, the average over ranks is "
                        f"{want.reshape(-1)[i].item():.6g} (off by {err.reshape(-1)[i].item():.2g})"],
                        _hint_grad(got, want, local[r][name], world_size, step))
    m = 4 * sum(g.numel() for g in avg.values())
    want_bytes = costs.sent("all_reduce", m, world_size)
    for r, res in enumerate(results):
        if res["quiet_bytes"]:
            return grader.Grade(False, [
                f"rank {r} sent {res['quiet_bytes']:,} bytes inside no_sync (micro-batch 0), where it "
                f"should send none: {res['quiet_bytes']:,} bytes too many"],
                "under no_sync the hook must return without communicating; the gradients add up in "
                ".grad, and the synced micro-batch's all-reduce averages the sum once.")
        for step, got in enumerate(res["steps"]):
            if got["bytes"] != want_bytes:
                more = got["bytes"] - want_bytes
                return grader.Grade(False, [
                    f"rank {r} sent {got['bytes']:,} bytes in the {('first', 'second')[step]} synced "
                    f"backward ({got['calls']} all-reduces); one ring all-reduce of every gradient, "
                    f"2(N-1)/N 4 Psi, is {want_bytes:,}: {abs(more):,} bytes "
                    f"{'too many' if more > 0 else 'too few'}"],
                    "put each gradient in exactly one bucket and all-reduce each bucket once per synced "
                    "backward, with comm.all_reduce.")
    model = net()
    names = {id(p): n for n, p in model.named_parameters()}
    plan = [[names[id(p)] for p in b.params] for b in HandDDP._make_buckets(list(model.parameters()), CAP)]
    buckets = len(plan)
    for r, res in enumerate(results):
        calls = next((step["calls"] for step in res["steps"] if step["calls"] != buckets), buckets)
        if calls != buckets:
            return grader.Grade(False, [
                f"rank {r} made {calls} all-reduce(s) in a synced backward; {CAP}-byte buckets "
                f"filled in reverse order make {buckets}: {'; '.join(', '.join(b) for b in plan)}"],
                "pack the gradients into buckets of bucket_cap_bytes, in reverse parameter order, closing "
                "one once it holds the cap or more; all-reduce each bucket once, when its gradients are "
                "ready: each all-reduce pays the latency term once.")
        last, started = res["ready"][-1] if res["ready"] else ("?", 0)
        if buckets > 1 and started == 0:
            return grader.Grade(False, [
                f"rank {r} started no all-reduce before its last gradient ({last}) was ready: the "
                f"{buckets} buckets all wait for the end of backward, so no communication overlaps it"],
                "launch a bucket's all-reduce from the hook of its last gradient, as soon as the bucket "
                "is full, not when the whole backward is done.")
    how = "bitwise" if exact else "within (2N-1) u sum|terms|"
    return grader.Grade(True, [
        f"bucketed DDP on {world_size} ranks, Psi = {m // 4} fp32 gradients, {CAP}-byte buckets, "
        "3 backwards: one under no_sync, then two synced",
        f"gradients: the average over ranks of the accumulated gradients ({how}) on every rank, "
        "after each synced backward",
        f"bytes: none inside no_sync; 2(N-1)/N 4 Psi = {want_bytes:,} per rank in each synced backward, "
        f"in {results[0]['steps'][0]['calls']} all-reduce(s), counted message by message"])


def _hint_grad(got, want, mine, n, step=0):
    got, want, mine = got.double(), want.double(), mine.double()
    if step and torch.allclose(got, mine, rtol=1e-5, atol=1e-7):
        return ("the first synced backward was averaged, the second was not: after a bucket's all-reduce, "
                "re-arm its count of ready gradients (DDP resets it before every backward).")
    if torch.allclose(got, n * want, rtol=1e-5, atol=1e-7):
        return f"the gradient is N = {n} times the average: divide the bucket by N (summed, not averaged)."
    if torch.allclose(got, mine, rtol=1e-5, atol=1e-7):
        return ("this gradient is the rank's own, never averaged over the ranks: hook every parameter "
                "(register_post_accumulate_grad_hook) and all-reduce each bucket once all its gradients "
                "are ready.")
    return ("a bucket's all-reduce must see every one of its gradients, accumulated over the micro-batches: "
            "launch it when the last of them is ready, and copy the average back into each .grad.")
