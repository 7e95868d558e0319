"""Chapter 6: the ring's wait on its neighbour, step by step, under the causal mask.

A ring step ends on a rank when the next K, V block has arrived, and its left neighbour posts that
block only when it begins the step, after its own compute of the step before. So a rank with
little to compute waits for a neighbour with much, and each step lasts about as long as the
busiest rank's compute: the sum over steps of the per-step maximum, not of the mean. Brandon et
al. 2023 (Striped Attention, arXiv 2311.09431) make this observation for the contiguous split of
ring attention (Liu et al. 2023).

The work per forward step follows from the tiles (`step_work_formula`, units of c^2/2 score
entries per batch and head, c = T/cp, beta = the kernel's diagonal block over c):
    contiguous  step 0: 1 + beta on every rank (the diagonal tile); step s >= 1: rank r computes a
                whole tile, 2 units, when its block's owner r - s comes before it (r >= s), else 0;
    zig-zag     step 0: 1 + beta; every later step 1 unit on every rank (two (c/2)^2 tiles).
`timed` records, on every rank and every forward step, when the step began, when its compute ended
and when the next block had arrived (`labs.measure.timing.now`: time.perf_counter, one clock for
all the processes of a Linux machine, read after the GPU's queued work where there is one): compute and wait
per step, and the compute's CPU time (time.process_time), which is what the step would take on a rank with a
core to itself: where ranks share cores, a rank that waits lends its core to the others and the wall-clock
compute stretches with the number of busy ranks. The timings are printed, never asserted; the work per step
is.

    python -m labs.context_parallel.ring_steps --world-size 4 --json
"""
import statistics
from fractions import Fraction

import torch
import torch.distributed as dist

from labs.launcher import launch
from labs.context_parallel import methods, ring_attention as ra


def step_work_formula(cp, order, beta=Fraction(0)):
    """Score entries computed per [step][rank], in units of c^2/2 per batch and head."""
    if order == "contiguous":
        return [[1 + beta] * cp] + [[2 if r >= s else 0 for r in range(cp)] for s in range(1, cp)]
    return [[1 + beta] * cp] + [[1] * cp for _ in range(1, cp)]


def timed(rank, world_size, seq_len=1024, heads=4, head_dim=64, batch=1, orders=methods.ORDERS, repeats=5,
          block=None):
    """Forward ring attention, causal, timed per step on this rank: for each order, per step the
    owner of the block, the score entries computed, and the median over ``repeats`` runs of the
    compute and of the wait for the next block (seconds)."""
    q, k, v, _ = methods.inputs(batch, heads, heads, seq_len, head_dim, launch.device())
    out = {}
    for order in orders:
        methods.check_config(world_size, seq_len, order, "ring", heads, heads, block)
        table = methods.layout(world_size, seq_len, order)
        rows = methods.rows_of(table[rank]).to(q.device)
        runs = []
        for _ in range(repeats):
            trace = []
            dist.barrier()
            with torch.no_grad():
                ra.ring_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], table, True, block=block,
                                  trace=trace)
            runs.append(trace)
        out[order] = [{"step": s["step"], "owner": s["owner"], "score_entries": s["score_entries"],
                       "compute_s": statistics.median(r[i]["computed"] - r[i]["began"] for r in runs),
                       "compute_cpu_s": statistics.median(r[i]["compute_cpu_s"] for r in runs),
                       "wait_s": statistics.median(r[i]["arrived"] - r[i]["computed"] for r in runs)}
                      for i, s in enumerate(runs[0])]
    return out


def step_units(steps, batch, heads, seq_len, cp):
    """A rank's measured score entries per step in `step_work_formula`'s units (exact)."""
    return [Fraction(2 * s["score_entries"], batch * heads * (seq_len // cp) ** 2) for s in steps]


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Ring attention's compute and wait per step and rank, contiguous against "
                   "zig-zag (causal).")
    p.add_argument("--seq-len", type=cli.at_most(1 << 14, "tokens"), default=1024)
    p.add_argument("--repeats", type=cli.at_most(50, "runs"), default=5)
    args = cli.parse(p, argv)
    for order in methods.ORDERS:
        methods.check_config(args.world_size, args.seq_len, order, "ring", 4, 4)
    results = launch.launch(timed, args.world_size, args.seq_len, 4, 64, 1, methods.ORDERS, args.repeats,
                            timeout=args.timeout)
    if results is None:
        return
    r = {order: {"compute_ms": [[round(1e3 * s["compute_s"], 2) for s in x[order]] for x in results],
                 "compute_cpu_ms": [[round(1e3 * s["compute_cpu_s"], 2) for s in x[order]] for x in results],
                 "wait_ms": [[round(1e3 * s["wait_s"], 2) for s in x[order]] for x in results],
                 "work": [[float(u) for u in step_units(x[order], 1, 4, args.seq_len, len(results))]
                          for x in results]}
         for order in methods.ORDERS}
    r["world_size"] = len(results)
    cli.report(r, args, "per rank, per step (ms): " + "; ".join(
        f"{o}: compute {r[o]['compute_ms']}, wait {r[o]['wait_ms']}" for o in methods.ORDERS))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
