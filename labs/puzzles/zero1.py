"""Chapter 16, puzzle 3 (chapter 3 teaches it): a ZeRO-1 sharded optimizer step.

The reader writes ``zero1_optimizer(params, lr)``: set up for the parameters (equal on every rank) and return
``step()``, which the grader calls after each backward. Flatten the parameters (Psi elements, a
multiple of N in the grader) and give rank r the slice [r Psi/N, (r+1) Psi/N). ``step`` must
reduce-scatter the gradients into the rank's slice and average them, run Adam (lr, betas 0.9 and
0.999, eps 1e-8) on that slice only, keeping its moments m and v for the slice alone, then
all-gather the updated slices into every rank's parameters. Collectives go through
``comm.reduce_scatter`` and ``comm.all_gather``. The reference is chapter 3's
`labs.zero.sharded_optimizer.ShardedOptimizer` with ``stage=1`` (`reference`).

The gradients are fixed inputs (the loss is sum(p * G) with G drawn per rank and step), so the
weights cannot feed back into them and the check needs no drift bound. They are drawn of the size
of Adam's eps (1e-8 times a normal draw): for gradients far above eps Adam's step
m / (sqrt(v) + eps) is nearly scale-invariant, and a gradient N times the average (the /N
forgotten) would move a weight by only about lr eps / |g|, far below the bound; at |g| ~ eps it
moves it by a good fraction of lr. Checked on every rank:
- the weights after 2 steps against one process running ``torch.optim.Adam`` on the average of the
  ranks' gradients: bitwise where Adam runs on the slice (the reference: the same elementwise ops;
  with N = 2 the sum of two gradients has one order); a hand-written Adam rounds in another order,
  so each step may move a weight by u |w| + 16 u lr S(t) more (u = 2^-24, S(t) the largest
  |Adam step| / lr, `labs.zero.adam_drift.adam_step_bound`, about 1 at t = 1, 2);
- the bytes: each step a reduce-scatter and an all-gather of Psi fp32 elements, counted message by
  message as chapter 2's hand rings (`hand_collectives`): 2 (N-1)/N 4 Psi per rank per step;
- what the rank keeps after the steps (storages still alive that are neither weights nor gradients,
  `labs.measure.memory.PeakMemory`, named by size when there are too many): Adam's m and v for its
  slice, 8 Psi/N bytes, plus up to 4 bytes per parameter tensor for the step counters
  ``torch.optim.Adam`` keeps. Anything else kept between steps counts too (a full flat gradient
  buffer, 4 Psi, or a flat copy of the weights, named as such when its bytes equal theirs), since the
  grader drops ``.grad`` after each step. A NaN in the weights is named as a NaN (`grader.nan_in`).
"""
import torch

from labs.data_parallel.hand_ring import hand_collectives
from labs.measure import comm, memory
from labs.puzzles import grader
from labs.zero.adam_drift import adam_step_bound
from labs.zero.sharded_optimizer import ShardedOptimizer

SHAPES = ((6, 4), (6,), (4, 6), (4,))  # Psi = 58: rank 0's slice ends inside the second tensor
NAMES = ("fc.weight", "fc.bias", "proj.weight", "proj.bias")
STEPS, LR, U = 2, 1e-2, 2.0**-24
SCALE = 1e-8  # gradients of the size of Adam's eps: the step depends on their scale
HINT_HANG = ("every rank makes the same collectives in the same order: one reduce-scatter, then one "
             "all-gather, with shards of the same size.")


def reference(params, lr):
    """Chapter 3's ZeRO-1 as the puzzle's step closure (gradients dropped after the step, as
    ``p.grad = None`` does for a hand-written one)."""
    opt = ShardedOptimizer(params, torch.optim.Adam, stage=1, lr=lr)

    def step():
        opt.step()
        opt.zero_grad()
        for b in opt.buckets:
            b.grad = None
    return step


def weights():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(s, generator=g) for s in SHAPES]


def gradient(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s, generator=g) * SCALE for s in SHAPES]


def check(rank, world_size, fn):
    """On one rank: the reader's step after each of 2 backwards; weights, bytes and state kept."""
    params = [torch.nn.Parameter(w) for w in weights()]
    with memory.PeakMemory(params) as mem, hand_collectives():
        step = fn(params, LR)
        with comm.counting() as tally:
            for t in range(STEPS):
                sum((p * g).sum() for p, g in zip(params, gradient(rank, t))).backward()
                step()
                for p in params:
                    p.grad = None
        kept = mem.end_bytes - memory.storage_bytes(params)
        mine = {p.untyped_storage()._cdata for p in params}
        live = [(ref(), n) for key, (ref, n) in list(mem.live.items()) if key not in mine]
    sizes = sorted((n for _, n in live), reverse=True)
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # a kept storage equal to it: a copy
    copies = sum(n == 4 * flat.numel() and torch.equal(torch.empty(0).set_(s), flat) for s, n in live if s)
    return {"weights": [p.detach().clone() for p in params], "bytes_sent": tally.bytes_sent,
            "ops": {op: e["calls"] for op, e in tally.ops.items() if e["calls"]}, "kept": kept,
            "kept_sizes": sizes, "weight_copies": copies}


def one_process(world_size, divide=True):
    params = [torch.nn.Parameter(w) for w in weights()]
    opt = torch.optim.Adam(params, lr=LR)
    for t in range(STEPS):
        grads = [gradient(r, t) for r in range(world_size)]
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in grads) / (world_size if divide else 1)
        opt.step()
    return [p.detach() for p in params]


def grade(fn, world_size=2, deadline=15.0):
    results = grader.run(check, fn, world_size, deadline, HINT_HANG)
    if isinstance(results, grader.Grade):
        return results
    want = one_process(world_size)
    psi = sum(w.numel() for w in want)
    shard = psi // world_size
    slack = sum(16 * U * LR * adam_step_bound(t + 1) for t in range(STEPS))
    exact = True
    for r, res in enumerate(results):
        offset = 0
        for name, got, ref in zip(NAMES, res["weights"], want):
            nan = grader.nan_in(r, name, got)
            if nan:
                return nan
            err = (got - ref).abs().reshape(-1)
            bound = STEPS * U * ref.abs().reshape(-1) + slack
            exact = exact and bool((err == 0).all())
            if grader.exceeds(err, bound).any():
                i = grader.worst(err, bound)
                owner = (offset + i) // shard
                if _matches(res["weights"], one_process(world_size, divide=False), slack):
                    return grader.Grade(False, [
                        f"rank {r}'s weights are the ones Adam gives for a gradient N = {world_size} times "
                        f"the average: the reduce-scattered gradient was never divided by N ({name}, "
                        f"element {i}: {got.reshape(-1)[i].item():.6g}, one process says "
                        f"{ref.reshape(-1)[i].item():.6g})"],
                        "reduce_scatter sums the ranks' gradients: divide your slice by N before Adam. "
                        "With large gradients Adam's step hides the factor; these are of the size of eps.")
                return grader.Grade(False, [
                    f"rank {r}'s {name} differs from one process at element {i} (in rank {owner}'s slice): "
                    f"{got.reshape(-1)[i].item():.6g}, one process says {ref.reshape(-1)[i].item():.6g} "
                    f"(off by {err[i].item():.2g})"], _hint_weights(r, owner, got, ref, err, i))
            offset += ref.numel()
    m = 4 * psi
    want_bytes = 2 * (world_size - 1) * m // world_size * STEPS
    for r, res in enumerate(results):
        if res["bytes_sent"] != want_bytes:
            more = res["bytes_sent"] - want_bytes
            return grader.Grade(False, [
                f"rank {r} sent {res['bytes_sent']:,} bytes in {STEPS} steps ({_ops(res['ops'])}); ZeRO-1 "
                f"sends 2(N-1)/N 4 Psi = {want_bytes // STEPS:,} per step, {want_bytes:,} in all: "
                f"{abs(more):,} bytes "
                f"{'too many' if more > 0 else 'too few'}"],
                "reduce-scatter the gradients (each rank needs the sum of its own slice only, (N-1)/N of "
                "the buffer) instead of all-reducing them (2(N-1)/N); then all-gather the new weights."
                if more > 0 else "each step needs a reduce-scatter of the gradients and an all-gather of the "
                "weights, through comm so they are counted.")
    state = 8 * shard
    for r, res in enumerate(results):
        if res["kept"] > state + 4 * len(SHAPES):
            sizes = res["kept_sizes"]
            return grader.Grade(False, [
                f"rank {r} keeps {res['kept']:,} bytes alive after the steps besides the weights (tensors "
                f"of {', '.join(f'{n:,}' for n in sizes[:6])}{', ...' if len(sizes) > 6 else ''} bytes); "
                f"ZeRO-1 keeps Adam's m and v for its slice, 8 Psi/N = {state:,} bytes, and at most "
                f"{4 * len(SHAPES)} bytes of step counters: {res['kept'] - state:,} bytes too many"],
                f"a tensor of 4 Psi = {4 * psi} bytes kept between steps holds a copy of the weights: the "
                "parameters are the weights; build the flat copy inside step() so that it is freed."
                if res["weight_copies"] else
                f"a tensor of 4 Psi = {4 * psi} bytes is kept: a flat gradient buffer or a full moment; "
                "build the flat gradient inside step() so that it is freed, and keep m and v for this "
                "rank's slice only." if 4 * psi in sizes else
                "keep m and v for this rank's slice only (Psi/N elements each); the full Adam state on "
                "every rank is plain data parallelism, 8 Psi per rank.")
    how = "bitwise" if exact else "within u |w| + 16 u lr S(t) per step"
    return grader.Grade(True, [
        f"ZeRO-1 with Adam, Psi = {psi} fp32 parameters in {len(SHAPES)} tensors on {world_size} ranks, "
        f"{STEPS} steps",
        f"weights: one process's ({how}) on every rank",
        f"bytes sent per rank per step: 2(N-1)/N 4 Psi = {want_bytes // STEPS:,}, counted message by "
        f"message",
        f"kept per rank after the steps: {', '.join(str(res['kept']) for res in results)} bytes: "
        f"m and v for the slice, 8 Psi/N = {state:,}, plus "
        + (f"{', '.join(str(res['kept'] - state) for res in results)} bytes of Adam's step counters (4 per "
           "tensor it steps)" if any(res["kept"] > state for res in results)
           else "no step counter tensor (up to 4 bytes per parameter tensor allowed)")
        + "; at N = 2, 8 Psi/N and the bytes per step, 2(N-1)/N 4 Psi, are both 4 Psi"])


def _matches(weights, want, slack):
    return all(not grader.exceeds((got - ref).abs(), STEPS * U * ref.abs() + slack).any()
               for got, ref in zip(weights, want))


def _ops(ops):
    return ", ".join(f"{n} {op}" for op, n in sorted(ops.items())) or "no collective"


def _hint_weights(rank, owner, got, ref, err, i):
    if owner != rank:
        return (f"rank {rank}'s own slice is right but rank {owner}'s is not: after the update, "
                "all-gather every rank's slice into the parameters.")
    return ("the update of this rank's own slice is wrong: average the reduce-scattered gradient "
            "(divide by N), and keep m and v from one step to the next.")
