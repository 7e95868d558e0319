"""Chapter 5: the same pieces and schedules run by PyTorch's own ``torch.distributed.pipelining``.

The tiny GPT is cut into the executor's pieces (`labs.pipeline.executor.split`), each wrapped in a
``PipelineStage``, and stepped by the library's GPipe, 1F1B, interleaved 1F1B, interleaved
zero-bubble, or V-shaped ZB-V and DualPipeV schedule; the gradients are compared with one
process's, as the hand executor's are. The V-shaped ones place chunks r and 2p - 1 - r on rank r
(`labs.pipeline.v_schedules`), and each run returns the compute order the library executed.
"""
import torch

from labs import model as tiny
from labs.launcher import launch
from labs.pipeline.executor import config, cross_entropy, microbatches, reference_grads, split


# torch.distributed.pipelining has no ZB-H1: its nearest is ScheduleInterleavedZeroBubble, the
# paper's automatic ZB-1p (§3, memory bound p M_B like ZB-H1), with v >= 1 chunks per rank.
LIBRARY = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
           "zb-h1": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble",
           "dualpipe-v": "ScheduleDualPipeV"}
V_SHAPED = ("zb-v", "dualpipe-v")  # two chunks per rank, r and 2p - 1 - r


def library(rank, world_size, schedule="1f1b", m=4, v=1, batch_size=2):
    """The same pieces under torch.distributed.pipelining: gradients against one process."""
    import torch.distributed.pipelining as pipelining
    if schedule not in LIBRARY:
        raise ValueError(f"torch.distributed.pipelining has no counterpart of {schedule!r}; "
                         f"choose one of {', '.join(LIBRARY)}.")
    p, cfg = world_size, config()
    pieces = split(tiny.build(cfg, seed=0), p * v)
    if schedule in V_SHAPED and v != 2:
        raise ValueError(f"{schedule} runs exactly two chunks per rank (v = 2), not v = {v}.")
    index = [rank, 2 * p - 1 - rank] if schedule in V_SHAPED else [c * p + rank for c in range(v)]
    mine = [pieces[i] for i in index]
    stages = [pipelining.PipelineStage(piece, i, p * v, launch.device()) for i, piece in zip(index, mine)]
    cls = getattr(pipelining, LIBRARY[schedule])
    # gradients are scaled by 1/m by the schedule, as the hand executor's loss is
    sched = cls(stages[0] if v == 1 and schedule in ("gpipe", "1f1b") else stages, n_microbatches=m,
                loss_fn=cross_entropy)
    data = microbatches(cfg, m, batch_size)
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    kwargs = {"target": y, "losses": []} if any(s.is_last for s in stages) else {}
    sched.step(x, **kwargs) if any(s.is_first for s in stages) else sched.step(**kwargs)
    ref = reference_grads(cfg, data)
    errors = [(q.grad - ref[n]).abs().max().item() for piece in mine for n, q in piece.named]
    order = getattr(sched, "pipeline_order", None) or {}
    compute = [[(x.computation_type.value, x.stage_index, x.microbatch_index)
                for a in order.get(r) or [] if a is not None for x in (a.sub_actions or (a,))]
               for r in range(p)]
    return {"max_abs_error_grad": max(errors), "schedule": cls.__name__, "order": compute}


def libraries(rank, world_size, configs, batch_size=2):
    """`library` for several (schedule, m, v) in one job."""
    return [library(rank, world_size, name, m, v, batch_size) for name, m, v in configs]
