"""Chapter 12: the work a failure loses while an asynchronous save is still being written.

A checkpoint of the state after step k is saved every tau steps. A synchronous save is committed
before step k + 1 starts; an asynchronous one returns after the copy and commits omega steps later,
when its background write ends. A job that dies after finishing step s restarts from the newest
*committed* checkpoint c(s), and loses s - c(s) steps:

    synchronous:    s - c(s) = s mod tau
    asynchronous:   s - c(s) = s mod tau + tau   while the save is in flight (s mod tau < omega)
                               s mod tau         once it has committed

Averaged over a failure at a uniform step, the asynchronous save loses omega steps more, and at
worst tau + omega - 1 instead of tau - 1: the price of not stopping for the write.

The lab trains the chapter's hand-FSDP run (`labs.checkpointing.training`) on 2 ranks with the hand
format's `sharded_checkpoint.async_save`; slow storage is modelled by holding each rank's last file:
rank 0's until omega - 1 steps after the save began, every other rank's until omega steps after,
so the commit, which must wait for the slowest rank's files, lands at omega. After every step
rank 0 reads from disk which checkpoint a restart would find (`sharded_checkpoint.latest`, which
verifies it). omega is therefore an input, not a measurement: the run tests that the commit waits
for every rank's files (a commit after rank 0's alone would land a step early), that a restart
finds the newest committed checkpoint and never one in flight, and that the lost steps follow
from those two.
`killed_in_flight` then kills the job for real while a save is in flight and reads what is left.
"""
import os
import signal
import tempfile
import threading

import torch.distributed as dist

from labs import model as tiny
from labs.launcher import launch
from labs.checkpointing import checkpoint_cost, sharded_checkpoint as sc, training
from labs.checkpointing.resharding import hand_state


def lost_formula(s, tau, omega):
    """Steps a job loses when it dies after step ``s`` (the formula in the module docstring; before
    the first checkpoint at step tau, a restart begins again at step 0)."""
    return checkpoint_cost.lost_steps(s, tau, omega)


@launch.on_cpu(sc.ON_CPU)
def _train(rank, world_size, root, steps, tau, omega, kill_after=None):
    """Train ``steps`` steps, save every ``tau`` (omega = 0: synchronously); after each step rank 0
    records the step of the newest committed checkpoint on disk. An asynchronous save's last file
    lands omega steps after it began on every rank but rank 0, where it lands a step earlier (at
    once if omega = 1). ``kill_after``: rank 1 kills itself with SIGKILL after that step (the whole
    job dies: the launcher stops the others)."""
    cfg, dev = tiny.GPTConfig(), launch.device()
    os.makedirs(root, exist_ok=True)
    net, hand, opt, sched, loader = training.build("hand", rank, world_size, cfg, dev)
    group = dist.new_group(backend="gloo")             # the writer's collectives, apart from training's
    pending, committed = None, []   # (future, gate, this rank's release step, the slowest rank's)
    for s in range(1, steps + 1):
        x, y = training.masked_batch(cfg, loader.next(), rank, world_size, dev)
        net(x, y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if pending and s >= pending[2]:                # this rank's slow write ends
            pending[1].set()
        if pending and s == pending[3]:                # every rank's has: the commit can land
            pending[0].result()
            pending = None
        if s % tau == 0:
            path = os.path.join(root, f"step-{s}")
            if omega == 0:
                sc.save(hand_state(hand, opt), path, group=group)
            else:
                gate = threading.Event()   # slow storage: the last file lands omega steps later
                hold = lambda f, g=gate: g.wait() if f.endswith(".json") else None  # noqa: E731
                early = s + omega - (rank == 0)       # rank 0 finishes a step before the others
                future = sc.async_save(hand_state(hand, opt), path, group, on_file=hold)
                pending = (future, gate, early, s + omega)
                if early == s:
                    gate.set()
        if rank == 0:
            newest = sc.latest(root)
            committed.append(int(os.path.basename(newest).split("-")[1]) if newest else 0)
        if s == kill_after and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    if pending:
        pending[1].set()
        pending[0].result()
    return committed


@launch.on_cpu(sc.ON_CPU)
def _both(rank, world_size, root, steps, tau, omega):
    """The same run with synchronous saves, then with asynchronous ones, in the same processes."""
    return {name: _train(rank, world_size, os.path.join(root, name), steps, tau, w)
            for name, w in (("sync", 0), ("async", omega))}


def _check(steps, tau, omega):
    if not 0 < omega < tau:
        raise ValueError(f"omega={omega} must be at least 1 and below tau={tau}: the next save waits for "
                         "the previous write.")
    if steps < 2 * tau:
        raise ValueError(f"steps={steps} must cover two checkpoint intervals (2 * tau = {2 * tau}).")


def window(steps=12, tau=4, omega=2, world_size=2, timeout=120.0):
    """Per step s: the newest committed checkpoint c(s) read from disk and the steps a failure
    would lose, s - c(s), for synchronous and asynchronous saves, beside `lost_formula`."""
    _check(steps, tau, omega)
    with tempfile.TemporaryDirectory(prefix="ckpt-window-") as root:
        runs = launch.spawn(_both, world_size, root, steps, tau, omega, timeout=timeout)[0]
    out = {"tau": tau, "omega": omega, "steps": list(range(1, steps + 1))}
    for name, w in (("sync", 0), ("async", omega)):
        out[f"{name}_committed"] = runs[name]
        out[f"{name}_lost"] = [s - c for s, c in zip(out["steps"], runs[name])]
        out[f"{name}_formula"] = [lost_formula(s, tau, w) for s in out["steps"]]
    # one full period after the first checkpoint (steady state): the mean of s - c(s) over a
    # uniform failure step, which the formula gives as (tau - 1) / 2 (+ omega); and over the whole
    # run, whose first steps, before any checkpoint, lose fewer
    period = slice(tau - 1, 2 * tau - 1)
    for name, w in (("sync", 0), ("async", omega)):
        out[f"{name}_mean_lost"] = sum(out[f"{name}_lost"][period]) / tau
        out[f"{name}_mean_formula"] = (tau - 1) / 2 + w
        out[f"{name}_run_mean_lost"] = sum(out[f"{name}_lost"]) / steps
    return out


def killed_in_flight(kill_after=9, steps=12, tau=4, omega=2, world_size=2, timeout=120.0):
    """Kill the job after step ``kill_after`` while an asynchronous save is in flight; read from disk
    the checkpoint a restart finds and the steps lost."""
    _check(steps, tau, omega)
    with tempfile.TemporaryDirectory(prefix="ckpt-inflight-") as root:
        try:
            launch.spawn(_train, world_size, root, steps, tau, omega, kill_after, timeout=timeout)
            raise AssertionError("the job whose rank was killed finished")
        except launch.RankError as exc:
            error = str(exc).splitlines()[0]
        newest = sc.latest(root)
        left = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    resumed = int(os.path.basename(newest).split("-")[1]) if newest else 0
    return {"error": error, "killed_after": kill_after, "resumes_at": resumed, "folders": left,
            "steps_lost": kill_after - resumed, "formula": lost_formula(kill_after, tau, omega)}
