"""Chapter 15's exercises: each answer computed by the chapter's own code, and the checker.

1. A trace: a 200 ms step, 150 ms of compute, 60 ms of communication in flight of which 20 ms
   run while the rank computes nothing. The overlap fraction? (`analysis.breakdown` on that trace.)
2. OPT-1.3B's fp32 gradients under DDP's default buckets (25 MiB cap) over 8 ranks at 50 GB/s per
   rank. DDP puts a tensor larger than the cap in a bucket of its own, and the tied embedding's
   gradient is complete only when backward ends. At least how many ms are exposed?
3. 1F1B on p = 4 equal stages with m = 8 micro-batches: what fraction of each stage's step does
   its trace show waiting for a peer (at no other cost)?
4. OPT-1.3B trained in fp32 with AdamW under FSDP FULL_SHARD on 8 ranks: GiB of parameters,
   gradients and optimizer state per rank between steps?
5. A collective matmul over t = 8 ranks: each chunk's transfer takes 3 ms, each chunk's matmul
   2 ms. How many ms of communication are exposed (the same ring without overlap exposes 21)?
"""
import torch
import torch.distributed as dist

from labs import model as tiny
from labs.measure import comm, exercises
from labs.formulas import schedules
from labs.profiling import analysis, opt_exercise
from labs.profiling.trace import STEP


def overlap_of(step_ms, compute_ms, comm_ms, exposed_ms):
    """The overlap fraction `analysis` finds in a one-rank trace with these totals: compute from 0,
    communication in flight on gloo's thread, ending ``exposed_ms`` after the compute does."""
    us = 1000.0
    start = compute_ms - (comm_ms - exposed_ms)

    def ev(name, a, b, tid, cat):
        return {"name": name, "cat": cat, "tid": tid, "ts": a * us, "dur": (b - a) * us, "args": {},
                "ph": "X"}
    events = [ev(f"{STEP}#0", 0, step_ms, 1, "user_annotation"), ev("aten::mm", 0, compute_ms, 1, "cpu_op"),
              ev("gloo:all_reduce", start, start + comm_ms, 2, "user_annotation")]
    return analysis.breakdown({"events": events})[0]["overlap_fraction"]


def opt_params():
    """OPT-1.3B's parameters, counted on the meta device (no memory used): tied head counted once."""
    with torch.device("meta"):              # built there, not built in memory and then moved
        return tiny.num_params(opt_exercise.build(opt_exercise.config(1), "meta"))


def last_bucket_bytes(cap_bytes=25 * 2**20):
    """Bytes of the bucket DDP reduces last for OPT-1.3B, from DDP's own assignment
    (`dist._compute_bucket_assignment_by_size`, as `DistributedDataParallel` calls it: the
    parameters in model order, a first bucket of `dist._DEFAULT_FIRST_BUCKET_BYTES`, then the cap;
    DDP reverses the buckets, so the one holding the first parameter, the tied embedding, is the
    last to be reduced). A tensor over the cap gets a bucket of its own."""
    with torch.device("meta"):
        params = list(opt_exercise.build(opt_exercise.config(1), "meta").parameters())
    buckets, _ = dist._compute_bucket_assignment_by_size(
        params, [dist._DEFAULT_FIRST_BUCKET_BYTES, cap_bytes], [False] * len(params))
    last = next(b for b in buckets if 0 in b)
    return sum(params[i].numel() * params[i].element_size() for i in last)


def last_bucket_ms(ranks=8, bytes_per_s=50e9):
    """That bucket's ring all-reduce: the bytes a rank sends (`comm.ring_allreduce_elements`)
    over its link."""
    return comm.ring_allreduce_elements(last_bucket_bytes() // 4, ranks, 0) * 4 / bytes_per_s * 1e3


def ring_exposed_ms(t, transfer_ms, matmul_ms):
    """t - 1 transfers, each under one chunk's matmul: what sticks out of each is exposed."""
    return (t - 1) * max(0.0, transfer_ms - matmul_ms)


EXERCISES = {
    "1": lambda: overlap_of(200, 150, 60, 20),
    "2": lambda: last_bucket_ms(),
    "3": lambda: schedules.formula("1f1b", 4, 8)["over_total"],
    "4": lambda: 16 * opt_params() / 8 / 2**30,
    "5": lambda: ring_exposed_ms(8, 3.0, 2.0),
}


def check(question, answer, rel=0.01):
    return exercises.check(EXERCISES, question, answer, rel)
