"""Chapter 5: the pipeline with data parallelism, and what m >= p does to the global batch.

pp x dp ranks on the grid of `labs.groups` (rank = d * pp + s): dp copies of one pipeline, each
running 1F1B (`labs.pipeline.executor.Executor`) on its own m micro-batches. Each stage's gradients are then
all-reduced over its data-parallel group, the dp ranks that hold the same stage: one all-reduce per
rank, carrying that stage's parameters only, issued as soon as the stage's last backward is done.

Where that is in the step, in 1F1B work units (F = t_F, B = t_B; Narayanan et al. 2021, SC21,
§2.2.1): the last micro-batch's backward leaves stage p-1 first and reaches stage 0 one t_B per
stage later, so stage s finishes at (m + p - 1)(t_F + t_B) - s t_B. Stage s's all-reduce can
overlap the s t_B of backwards that stages 0 .. s-1 still run; only stage 0's is fully exposed.

The global batch (item "m >= p"): a bubble target sets m (`schedules.microbatches_for`), and
global batch = m x micro-batch x dp sequences. `global_batch` works it for Llama 3 405B's Table 4.

    launch.spawn(pipeline_dp.run, 4, 2)      # 4 ranks, pp = 2, dp = 2
"""
import time

import torch

from labs.launcher import launch
from labs.measure import comm
from labs import groups, model as tiny
from labs.dims import ParallelDims
from labs.formulas import schedules
from labs.pipeline import executor


class Executor(executor.Executor):
    """The hand executor with each stage index mapped to the global rank of this pipeline's stage."""

    def __init__(self, *args, stage_ranks, **kwargs):
        super().__init__(*args, **kwargs)
        self.stage_ranks = stage_ranks

    def _send(self, t, dst, tag, clock):
        super()._send(t, self.stage_ranks[dst], tag, clock)

    def _recv(self, shape, src, tag):
        return super()._recv(shape, self.stage_ranks[src], tag)


def finish_times(p, m, t_f=1, t_b=2):
    """Per stage, when its last backward ends under 1F1B: (m + p - 1)(t_F + t_B) - s t_B."""
    return [(m + p - 1) * (t_f + t_b) - s * t_b for s in range(p)]


@launch.on_cpu("chapter 5's executor, a CPU emulation of pipeline timing")
def run(rank, world_size, pp=2, m=4, batch_size=2, unit_seconds=0.02):
    """One 1F1B step on pp x dp ranks, then each stage's all-reduce over its DP group: counted calls
    and bytes, the logical time it is issued, wall-clock times, and the gradient error against one
    process over all dp x m micro-batches."""
    lay = ParallelDims.build(world_size, pp=pp)
    g = groups.Groups(lay)
    stage, d, dp = g.coords["pp"], g.coords["dp"], lay.dp
    cfg = executor.config()
    piece = executor.split(tiny.build(cfg, seed=0), pp)[stage]
    everything = [tiny.synthetic_batch(cfg, batch_size, seed=i) for i in range(dp * m)]
    data = everything[d * m:(d + 1) * m]                   # this replica's own micro-batches
    executor.measure_pieces([piece], data[0], cfg.hidden)  # warm-up (see measure_pieces)
    actions = schedules.one_f_one_b(pp, m)[stage]
    ex = Executor([piece], stage, pp, 1, schedules.costs("1f1b"), unit_seconds, data, m, cfg.hidden,
                  stage_ranks=g.pp_ranks)
    torch.distributed.barrier()
    t0 = time.perf_counter()
    with comm.counting() as tally:
        ex.run(actions)                  # its last action is its last backward (1F1B has no W)
        issued, wall_issued = ex.clock, time.perf_counter() - t0
        # one bucket: the mean over the DP group of this stage's gradients (each replica's loss is
        # already the mean over its m micro-batches, so the sum / dp is the mean over dp x m)
        flat = torch.cat([q.grad.reshape(-1) for q in piece.parameters()])
        work = comm.all_reduce(flat, group=g.dp, async_op=True)
        work.wait()
        wall_done = time.perf_counter() - t0
    flat /= dp
    offset = 0
    for q in piece.parameters():
        q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
        offset += q.numel()
    ref = executor.reference_grads(cfg, everything)
    error = max((q.grad - ref[n]).abs().max().item() for n, q in piece.named)
    ar = tally.ops["all_reduce"]
    return {"rank": rank, "stage": stage, "dp_rank": d, "dp_group": g.dp_ranks, "pp_group": g.pp_ranks,
            "allreduce_calls": ar["calls"], "allreduce_payload_bytes": ar["payload_bytes"],
            "allreduce_formula_bytes_sent": ar["formula_bytes_sent"],
            "p2p_bytes_sent": tally.bytes_sent,
            "stage_param_bytes": sum(q.numel() * q.element_size() for q in piece.parameters()),
            "model_param_bytes": sum(q.numel() * q.element_size() for q in tiny.build(cfg).parameters()),
            "issued_at": issued, "events": ex.events, "wall_issued": wall_issued, "wall_done": wall_done,
            "max_abs_error_grad": error}


def global_batch(row=None, micro_batch=1, target=0.05):
    """Llama 3 405B, Table 4 (Llama Team 2024, arXiv 2407.21783, §3.3.2): sequences per DP rank =
    tokens per batch / (seq x dp); with micro-batch b, m = that / b; 1F1B's bubble at that m, and
    interleaved's at v chunks (the paper prints no V). And the other way: the m a bubble target
    needs, and the global batch (m x b x dp sequences, in tokens) it would force."""
    from labs.memory_budget.compute import LLAMA3_405B_TABLE4, LLAMA3_TOKENS_PER_BATCH
    r = row or LLAMA3_405B_TABLE4[1]
    seqs = LLAMA3_TOKENS_PER_BATCH // r["seq"]
    if seqs % (r["dp"] * micro_batch):
        raise ValueError(f"{seqs} sequences do not split into dp={r['dp']} x micro-batch {micro_batch}; "
                         "choose a micro-batch dividing the sequences per DP rank.")
    per_dp = seqs // r["dp"]
    m, p = per_dp // micro_batch, r["pp"]
    need = schedules.microbatches_for(p, target)
    return {"gpus": r["gpus"], "tp": r["tp"], "cp": r["cp"], "pp": p, "dp": r["dp"], "seq": r["seq"],
            "tokens_per_batch": LLAMA3_TOKENS_PER_BATCH, "sequences": seqs, "per_dp": per_dp,
            "table_batch_per_dp": r["batch_per_dp"], "micro_batch": micro_batch, "m": m,
            "global_batch_sequences": m * micro_batch * r["dp"],
            "bubble_1f1b": schedules.formula("1f1b", p, m)["over_total"],
            "bubble_interleaved": {v: schedules.formula("interleaved", p, m, v)["over_total"]
                                   for v in (2, 4, 8)},
            "target": target, "m_for_target": need,
            "tokens_for_target": need * micro_batch * r["dp"] * r["seq"]}
