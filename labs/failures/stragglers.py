"""Chapter 13: a straggler, one rank slower than its peers every step, found from step times.

A synchronous job runs at the pace of its slowest rank: the all-reduce waits for it, so every rank's
*step* time grows alike and names no one. Each rank's *compute* time (before the all-reduce) does
show it, so every rank all-gathers its compute times and the rank that stays several times above
the median of the others for a few steps in a row is named (`find_straggler`).
"""
import statistics
import time

import torch
import torch.distributed as dist

from labs.failures import fault_training as ft
from labs.launcher import launch


def timed_steps(rank, world_size, steps, slow_rank, delay_s):
    """``steps`` DDP steps; returns every rank's compute time (before the all-reduce, where a slow
    rank shows) and this rank's full step time (equal on all ranks: the all-reduce waits)."""
    model, opt = ft.make_model()
    compute, total = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        loss, g = ft.local_grad(model, *ft.batch(step, rank, world_size))
        if rank == slow_rank:
            time.sleep(delay_s)  # thermal throttling, a noisy neighbour, a slow disk
        t1 = time.perf_counter()
        ft.apply(model, opt, ft.average(g, world_size))
        compute.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    times = torch.tensor(compute, dtype=torch.float64)  # (steps,)
    everyone = [torch.empty_like(times) for _ in range(world_size)]
    dist.all_gather(everyone, times)
    return {"compute": torch.stack(everyone).tolist(), "step": total,  # compute: (world, steps)
            "loss": ft.mean_loss(loss, world_size)}


@launch.on_cpu("the straggler is a sleep, and compute is timed by the host clock between collectives")
def timed_both(rank, world_size, steps, slow_rank, delay_s):
    """A clean run then a slowed one, in the same processes (so the ratio compares like with like)."""
    return (timed_steps(rank, world_size, steps, None, 0.0),
            timed_steps(rank, world_size, steps, slow_rank, delay_s))


def find_straggler(compute, ratio=3.0, gap_s=0.01, confirm=3):
    """(rank, step) at which one rank's compute time has been above ``ratio`` times the median of
    the others' and ``gap_s`` longer for ``confirm`` steps in a row, or (None, None)."""
    world, run = len(compute), {}
    for s in range(len(compute[0])):
        for r in range(world):
            others = statistics.median(compute[o][s] for o in range(world) if o != r)
            slow = compute[r][s] > ratio * others and compute[r][s] - others > gap_s
            run[r] = run.get(r, 0) + 1 if slow else 0
            if run[r] >= confirm:
                return r, s
    return None, None


def straggler(world_size=3, slow_rank=2, delay_s=0.03, steps=10, timeout=60.0):
    """The scenario: a clean run and a run with ``slow_rank`` sleeping ``delay_s`` every step; who is
    named, when, whether the clean run raises a false alarm, and the job's slowdown (printed)."""
    clean, slow = zip(*launch.spawn(timed_both, world_size, steps, slow_rank, delay_s, timeout=timeout))
    rank, at = find_straggler(slow[0]["compute"])
    false_alarm, _ = find_straggler(clean[0]["compute"])
    step_time = [statistics.median(max(r["step"][s] for r in res) for s in range(steps)) for res in (clean,
                                                                                                     slow)]
    return {"scenario": "straggler", "world_size": world_size, "injected_rank": slow_rank,
            "detected": rank is not None, "detected_rank": rank, "detected_at_step": at,
            "seconds_to_detect": sum(slow[0]["step"][:at + 1]) if at is not None else None,
            "false_alarm_clean": false_alarm, "steps_lost": 0,
            "final_loss_match": slow[0]["loss"] == clean[0]["loss"],
            "clean_step_s": step_time[0], "slow_step_s": step_time[1],
            "slowdown": step_time[1] / step_time[0], "delay_s": delay_s}
