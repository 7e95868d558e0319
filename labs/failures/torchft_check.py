"""Chapter 13: what the torchft run's logs say, and the replay that predicts them.

`labs.failures.torchft_run` leaves one log per replica group. This module reads the figures out
of them (the step turned down, the steps with the smaller quorum, the time to the new quorum, the
restart, the recovery's bytes and seconds, the rejoin) and checks them against a replay: the
same model, data and optimizer in this one process, stepping with the gradients of exactly the
replicas the logs say took part in each step (torchft averages over them: torchft/manager.py,
``Manager.allreduce``). Where the replay runs the same operations in the same order as the
replicas did, it must match them bit for bit: from the state a survivor saved before the kill,
through every step with the smaller quorum (a sum of two gradients is the same in either order,
and the joining replica adds zeros). After the rejoin three gradients are summed in gloo's order,
not the replay's, so it matches only to fp32 rounding.
"""
import statistics

import torch

from labs import model as tiny
from labs.failures import torchft_replica as rep


def committed(log):
    """{step: the entry of the committed step} of one replica's log."""
    return {e["step"]: e for e in log if e["event"] == "step" and e["committed"]}


def events(log, name):
    return [e for e in log if e["event"] == name]


def agree(logs):
    """Do all replicas that committed a step hold the same bytes after it (weights and optimizer)?
    Returns (every step agrees, the steps that were compared by at least two replicas)."""
    by_step = {}
    for log in logs.values():
        for s, e in committed(log).items():
            by_step.setdefault(s, set()).add(e["digest"])
    shared = sorted(s for s in by_step if sum(s in committed(log) for log in logs.values()) > 1)
    return all(len(by_step[s]) == 1 for s in shared), shared


def summarize(fault, reference):
    """The measurements of one killed-and-restarted run, next to the uninterrupted one."""
    n, k = fault["replicas"], fault["kill_step"]
    logs, kill = fault["logs"], fault["events"]["kill"]
    victim = next(i for i, log in logs.items() if events(log, "start")[1:])  # started twice
    survivor = logs[steady_survivor(logs, victim, n)]
    steps = [e for e in survivor if e["event"] == "step"]
    down = [e for e in steps if not e["committed"]]
    small = [e for e in steps if e["committed"] and e["participants"] < n]
    second = logs[victim][[e["event"] for e in logs[victim]].index("start", 1):]  # its second life
    rec = events(second, "recovered")[0]
    back = next(e for e in second if e["event"] == "step" and e["committed"] and e["participants"] == n)
    before = committed(survivor)
    ref = committed(reference["logs"][0])
    same_before = all(before[s]["digest"] == ref[s]["digest"] and before[s]["held_out"] == ref[s]["held_out"]
                      for s in range(k))
    agreed, compared = agree(logs)
    return {
        "replicas": n, "kill_step": k, "victim": victim, "survivor": steady_survivor(logs, victim, n),
        "killed_returncode": kill["returncode"],
        "turned_down": [e["step"] for e in down],
        # a step turned down leaves weights and optimizer as they were before it
        "turned_down_untouched": all(e["digest"] == before[e["step"] - 1]["digest"] for e in down),
        "small_quorum_steps": [e["step"] for e in small], "small_quorum_size": sorted({e["participants"]
                                                                                       for e in small}),
        "new_quorum_s": small[0]["quorum_at"] - kill["time"],
        "restart_started_s": events(second, "start")[0]["time"] - kill["time"],
        "recovered_step": rec["step"], "recovered_bytes": rec["bytes"], "recovery_s": rec["seconds"],
        "recovered_s": rec["time"] - kill["time"],
        "rejoined_step": back["step"], "rejoined_s": back["quorum_at"] - kill["time"],
        "state_bytes": state_bytes(fault["state_before_kill"][steady_survivor(logs, victim, n)]),
        "same_as_reference_before_kill": same_before, "replicas_agree": agreed,
        "steps_compared_across_replicas": len(compared),
        "healed_replica_agrees": all(committed(logs[victim])[s]["digest"] == before[s]["digest"]
                                     for s in committed(second) if s in before),
        "final_step": max(before), "pids": fault["pids"],
        "held_out": {s: e["held_out"] for s, e in before.items()},
        "reference_held_out": {s: e["held_out"] for s, e in ref.items()},
        "schedule": {s: (list(range(n)) if e["participants"] == n else
                         [i for i in range(n) if i != victim]) for s, e in before.items()},
    }


def steady_survivor(logs, victim, n):
    """A survivor that committed every step from 0 on, each with all ``n`` groups or all but the
    victim: the replay's schedule is read from its log. On a loaded machine a survivor whose
    heartbeat lapsed can be left out of a quorum and heal, jumping over step numbers (the replay
    would then ask for a step its log lacks); such a run is refused here, by name."""
    for i in sorted(i for i in logs if i != victim):
        done = committed(logs[i])
        if sorted(done) == list(range(len(done))) and all(
                e["participants"] in (n, n - 1) for e in done.values()):
            return i
    raise RuntimeError("no survivor committed every step with the whole quorum or all but the killed "
                       "group: one was left out of a quorum (a heartbeat late on a loaded machine?)")


def state_bytes(state):
    """Bytes of the tensors a peer must send: the weights and the momentum buffers (storage)."""
    tensors = list(state["model"].values())
    tensors += [v for s in state["optim"]["state"].values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _step(model, opt, step, replicas, data_offset=0):
    """One step as torchft takes it: the sum of the replicas' flat gradients, divided by their
    number, then SGD (the same operations as `torchft_replica.average`)."""
    flat = None
    for r in replicas:
        opt.zero_grad()
        x, y = rep.batch(step + data_offset, r)
        model(x, y).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])   # (P,)
        flat = g if flat is None else flat + g
    flat /= len(replicas)
    i = 0
    for p in model.parameters():
        p.grad.copy_(flat[i:i + p.numel()].view_as(p))
        i += p.numel()
    opt.step()


def replay_exact(summary, state, survivor_log):
    """From a survivor's state before the killed step, replay every step until the rejoin with the
    survivors' gradients: the bytes after each must equal the survivor's, bit for bit."""
    torch.set_num_threads(1)  # as in each replica: the same kernels, the same bits
    model, opt = tiny.build(rep.CFG, seed=0), None
    opt = rep.optimizer(model)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    logged, out = committed(survivor_log), []
    for s in range(summary["kill_step"], summary["rejoined_step"]):
        _step(model, opt, s, summary["schedule"][s])
        out.append(rep.digest(model, opt) == logged[s]["digest"])
    return {"steps": list(range(summary["kill_step"], summary["rejoined_step"])), "equal": out}


def replay(schedule, steps, data_offset=0):
    """Held-out loss after each step of a run that averages ``schedule[s]``'s gradients at step s."""
    torch.set_num_threads(1)
    model = tiny.build(rep.CFG, seed=0)
    opt = rep.optimizer(model)
    losses = []
    for s in range(steps):
        _step(model, opt, s, schedule[s], data_offset)
        losses.append(rep.held_out_loss(model))
    return losses


def trajectory(summary, noise_runs=2):
    """The loss after the fault against the uninterrupted run, and against the replay's prediction.

    The run with a smaller quorum saw, in each of those steps, two thirds of the rows; the
    average it stepped with has the same expectation as the full one and more noise. So its loss
    is set beside the spread between uninterrupted runs on other data (``noise_runs`` replays with
    other batches): a scale, not a matched control. The gap is taken twice: at the reference's last
    step (the killed run may still be inside its outage there) and at the killed run's own last
    step, against the uninterrupted job replayed as long. The replay of the run's own schedule
    must predict it to fp32 rounding over all of its steps."""
    n = summary["replicas"]
    run_steps = summary["final_step"] + 1
    steps = min(run_steps, max(summary["reference_held_out"]) + 1)
    full = {s: list(range(n)) for s in range(run_steps)}
    fault = [summary["held_out"][s] for s in range(run_steps)]
    predicted = replay(summary["schedule"], run_steps)
    # the uninterrupted job replayed as long as the killed run went on (it matches the real
    # uninterrupted run over that run's steps to fp32 rounding: reference_replay_error)
    long_run = replay(full, run_steps)
    uninterrupted = long_run[:steps]
    noise = [replay(full, run_steps, data_offset=10**5 * (j + 1)) for j in range(noise_runs)]
    reference = [summary["reference_held_out"][s] for s in range(steps)]
    return {
        "steps": steps, "run_steps": run_steps, "fault": fault, "reference": reference,
        "predicted": predicted, "uninterrupted_replay": uninterrupted,
        "gap": [f - r for f, r in zip(fault, reference)],
        "prediction_error": max(abs(f - p) for f, p in zip(fault, predicted)),
        "reference_replay_error": max(abs(r - u) for r, u in zip(reference, uninterrupted)),
        "noise_at_end": statistics.median(abs(nz[steps - 1] - uninterrupted[-1]) for nz in noise),
        # at the reference's last step (steps - 1) the killed run may still be inside its outage
        "gap_at_end": fault[steps - 1] - reference[-1],
        # at the killed run's own last step, against the uninterrupted job replayed as long
        "gap_final": fault[-1] - long_run[-1],
        "noise_final": statistics.median(abs(nz[-1] - long_run[-1]) for nz in noise),
        "misreadings": misreadings(summary, fault, run_steps),
    }


def misreadings(summary, fault, steps):
    """How far replays of two wrong readings of torchft land from the run: the joining replica's
    gradient counted in its heal step, and the step turned down kept (with all three gradients).
    The prediction check is only worth its tolerance if these miss by more."""
    heal, down = summary["recovered_step"], summary["turned_down"][0]
    out = {}
    for name, step in (("heal_step_counted", heal), ("turned_down_kept", down)):
        wrong = dict(summary["schedule"])
        wrong[step] = list(range(summary["replicas"]))
        out[name] = max(abs(f - w) for f, w in zip(fault, replay(wrong, steps)))
    return out
