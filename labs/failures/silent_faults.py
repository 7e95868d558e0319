"""Chapter 13: the faults that raise no error. A bit flipped in one replica's gradient (silent data
corruption) and a bad batch that makes the loss spike; both on `labs.failures.fault_training`'s DDP job.

- SDC: after the all-reduce every replica must hold the same bytes. An all-gather of a 64-bit
  hash of each replica's gradient catches a single flipped bit within the step; the step is
  rejected, the all-reduce redone, and the rank whose bytes differ from the redo is named.
- Loss spike (PaLM, Chowdhery et al. 2022, section 5.1: "restarted training from a checkpoint
  roughly 100 steps before the spike started, and skipped roughly 200-500 data batches"): a
  robust detector (loss above ``ratio`` times the running median, ``confirm`` steps in a row)
  rolls back to the last checkpoint taken before the spike began, not the latest one, and skips
  every batch seen since it.
"""
import statistics
import time

import torch

from labs.failures import fault_training as ft
from labs.launcher import launch


def flip_bit(flat, index, bit):
    """Flip bit ``bit`` of float32 element ``index`` in place, through the tensor's int32 view."""
    flat.view(torch.int32)[index] ^= 1 << bit
    return flat


def sdc_rank(rank, world_size, steps, bad_step, bad_rank, bit, check):
    """DDP training; ``bad_rank``'s averaged gradient gets one bit flipped at ``bad_step``.

    With ``check``: each step all-gathers a hash of every replica's averaged gradient; on a
    mismatch the update is rejected and the all-reduce redone. Returns the events and a hash of the
    final weights from every rank (replicas that disagree have diverged)."""
    model, opt = ft.make_model()
    events = []
    for step in range(steps):
        loss, local = ft.local_grad(model, *ft.batch(step, rank, world_size))
        g = ft.average(local, world_size)
        flipped_at = time.perf_counter()
        if step == bad_step and rank == bad_rank:
            flip_bit(g, 3, bit)
        if check and len(set(ft.gather(ft.digest(g), world_size))) > 1:
            before = ft.digest(torch.nn.utils.parameters_to_vector(model.parameters())).item()
            redo = ft.average(local, world_size)            # the all-reduce again, from local grads
            differs = torch.tensor([float(not torch.equal(redo.view(torch.int32), g.view(torch.int32)))])
            culprits = [r for r, d in enumerate(ft.gather(differs, world_size)) if d]
            after = ft.digest(torch.nn.utils.parameters_to_vector(model.parameters())).item()
            events.append({"step": step, "culprits": culprits, "weights_unchanged": before == after,
                           "seconds": time.perf_counter() - flipped_at})
            g = redo
        ft.apply(model, opt, g)
    final = ft.digest(torch.nn.utils.parameters_to_vector(model.parameters()))
    return {"events": events, "loss": ft.mean_loss(loss, world_size),
            "weights": ft.gather(final, world_size)}


@launch.on_cpu(ft.ON_CPU)
def sdc_runs(rank, world_size, steps, bad_step, bad_rank, bit):
    """The same job three times in one spawn: clean, flipped and checked, flipped and unchecked."""
    return {name: sdc_rank(rank, world_size, steps, bad_step, bad_rank if flip else None, bit, check)
            for name, flip, check in (("clean", False, True), ("checked", True, True), ("unchecked", True,
                                                                                        False))}


def sdc(world_size=3, bad_rank=1, steps=6, bad_step=2, bit=20, timeout=60.0):
    """Clean run, the flip caught by the hash check, the flip unchecked. The default, bit 20, is
    the third-highest of fp32's 23 mantissa bits: flipping it moves the element by 2^-3 of its
    leading power of two (1/16 to 1/8 of its value), which no norm threshold over the gradient
    would notice; bit 0, the lowest, would move it by one unit in the last place."""
    runs = launch.spawn(sdc_runs, world_size, steps, bad_step, bad_rank, bit, timeout=timeout)[0]
    events = runs["checked"]["events"]
    first = events[0] if events else {}
    return {"scenario": "sdc", "world_size": world_size, "injected_rank": bad_rank, "bit": bit,
            "detected": bool(events), "detected_rank": (first.get("culprits") or [None])[0],
            "detected_at_step": first.get("step"), "seconds_to_detect": first.get("seconds"),
            "weights_unchanged_on_reject": first.get("weights_unchanged"), "steps_lost": 0,
            "false_alarms_clean": len(runs["clean"]["events"]),
            "final_loss_match": runs["checked"]["loss"] == runs["clean"]["loss"],
            "replicas_agree_checked": len(set(runs["checked"]["weights"])) == 1,
            "replicas_agree_unchecked": len(set(runs["unchecked"]["weights"])) == 1,
            "distinct_models_unchecked": replica_groups(runs["unchecked"]["weights"])}


def replica_groups(hashes):
    """The ranks grouped by the hash of their final weights: [[ranks holding one model], ...],
    in order of their lowest rank. One group: every replica is the same model."""
    groups = {}
    for rank, h in enumerate(hashes):
        groups.setdefault(h, []).append(rank)
    return sorted(groups.values())


def spike_rank(rank, world_size, steps, every, bad_batch, scale, skip=(), ratio=3.0, confirm=2, window=5):
    """DDP training over batch ids 0, 1, ... (minus ``skip``), in-memory checkpoints every ``every``
    steps. Batch ``bad_batch`` has its inputs scaled by ``scale``. On a detected spike: roll back to
    the newest checkpoint taken before the spike's first step, skip every batch id seen since."""
    model, opt = ft.make_model()
    ckpts, history, skipped, rollback, log = {}, [], list(skip), None, []
    step, next_batch, bad_at = 0, 0, None
    while step < steps:
        if step % every == 0 and step not in ckpts:
            ckpts[step] = ft.state(model, opt, step, next_batch)
        while next_batch in skipped:
            next_batch += 1
        if next_batch == bad_batch:
            bad_at = time.perf_counter()
        loss = ft.step(model, opt, next_batch, rank, world_size, scale if next_batch == bad_batch else 1.0)
        history.append((step, next_batch, loss))
        log.append((step, next_batch, loss))  # every step run, the rolled-back ones too
        step, next_batch = step + 1, next_batch + 1
        first = spike_start(history, ratio, confirm, window)
        if first is not None and rollback is None:
            # taken before the spike began: healthy when the spike shows in the bad batch's own loss
            # (this lab's fault); a spike that shows a step after its cause would need s < first[0]
            good = max(s for s in ckpts if s <= first[0])
            rollback = {"detected_at_step": step - 1, "spike_started_step": first[0],
                        "seconds": time.perf_counter() - bad_at if bad_at else None,
                        "latest_checkpoint": max(ckpts), "chosen_checkpoint": good,
                        "latest_loss": held_out_loss(ckpts[max(ckpts)], rank, world_size),
                        "chosen_loss": held_out_loss(ckpts[good], rank, world_size)}
            step, resume = ft.restore(model, opt, ckpts[good])
            skipped += list(range(resume, next_batch))
            ckpts = {s: c for s, c in ckpts.items() if s <= good}
            history = [h for h in history if h[0] < good]
    return {"loss": loss, "rollback": rollback, "skipped": skipped, "batches": [h[1] for h in history],
            "log": log}


def spike_start(history, ratio, confirm, window):
    """The (step, batch, loss) where a spike began: the last ``confirm`` losses all above ``ratio``
    times the median of the ``window`` losses before them. None while there is no spike."""
    if len(history) < window + confirm:
        return None
    base = statistics.median(h[2] for h in history[-window - confirm:-confirm])
    recent = history[-confirm:]
    return recent[0] if all(h[2] > ratio * base for h in recent) else None


def held_out_loss(snap, rank, world_size):
    """Loss of a checkpoint's weights on a batch never trained on: how healthy it really is."""
    model, opt = ft.make_model()
    ft.restore(model, opt, snap)
    x, y = ft.batch(10_000, rank, world_size)
    with torch.no_grad():
        return ft.mean_loss(torch.nn.functional.mse_loss(model(x), y), world_size)


@launch.on_cpu(ft.ON_CPU)
def spike_runs(rank, world_size, steps, every, bad_batch, scale):
    """The spike and its recovery, then a clean run over the batches the recovery kept."""
    hurt = spike_rank(rank, world_size, steps, every, bad_batch, scale)
    return hurt, spike_rank(rank, world_size, steps, every, None, 1.0, hurt["skipped"])


def loss_spike(world_size=2, bad_rank=None, steps=16, every=2, bad_batch=9, scale=30.0, timeout=60.0):
    """The spike and its recovery, then a clean run that never sees the skipped batches: the two
    must end on the same loss, bit for bit. (``bad_rank`` is unused: a batch is every rank's.)"""
    hurt, clean = launch.spawn(spike_runs, world_size, steps, every, bad_batch, scale, timeout=timeout)[0]
    rb = hurt["rollback"] or {}
    return {"scenario": "loss-spike", "world_size": world_size, "bad_batch": bad_batch, "scale": scale,
            "detected": bool(rb), "detected_rank": None, **rb, "skipped": hurt["skipped"],
            "seconds_to_detect": rb.get("seconds"),
            "steps_lost": rb["detected_at_step"] + 1 - rb["chosen_checkpoint"] if rb else None,
            "final_loss": hurt["loss"], "final_loss_match": hurt["loss"] == clean["loss"],
            "batches": hurt["batches"], "log": hurt["log"], "clean_log": clean["log"]}
