"""The training script `labs.failures.elastic` runs under ``torchrun --max-restarts``: one worker.

It trains chapter 13's tiny DDP job (`labs.failures.fault_training`) on gloo, rank 0 saving a
checkpoint every ``--every`` steps, and resumes from the latest one when torchrun starts it again:
torchrun restarts the processes, resuming is the script's own job (torch/distributed/run.py,
"Failure Modes"). It reads the attempt number from ``TORCHELASTIC_RESTART_COUNT`` (set by the
local elastic agent for every worker it starts). On attempt 0, rank ``--kill-rank`` SIGKILLs itself
after ``--kill-step`` steps. Every rank writes what it did, after every step, to
``<folder>/rank<r>_attempt<a>.json`` (the workers' stdout is interleaved by torchrun): the steps it
ran, their losses, where it resumed, its final weights, and, once a run finishes, the losses and
weights of an uninterrupted run of the same job in the same processes (the reference).

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 -m labs.failures.elastic_worker \\
        --folder /tmp/run --steps 8 --every 3 --kill-step 5
"""
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from labs.failures import fault_training as ft


def _write(path, record):
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # the reader never sees half a record, even after a SIGKILL


def _weights(model):
    return [v.flatten().tolist() for v in model.state_dict().values()]  # float32 -> float64: exact


def attempt_store():
    """The agent's TCPStore, under a prefix of its own for this attempt.

    torchrun's workers all connect to one store that the agent's rendezvous keeps across restarts
    (dynamic_rendezvous.py makes the shared TCPStore server once, although a comment in rendezvous.py says a
    new one is made for every retry; the lab reads one port for both attempts). The keys in which attempt 0's
    ranks published their gloo addresses are still there, so a plain ``init_process_group`` on attempt 1 can
    read a dead rank's address and fail with "Connection refused"; a prefix per attempt gives each attempt a
    clean namespace."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False)
    return dist.PrefixStore(f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def uninterrupted(rank, world_size, steps):
    """The same job from step 0 to the end without a checkpoint or a kill: the reference."""
    model, opt = ft.make_model()
    losses = [ft.step(model, opt, s, rank, world_size) for s in range(steps)]
    return {"losses": losses, "weights": _weights(model)}


def work(folder, steps, every, kill_step, kill_rank):
    """One worker's life in one attempt; returns its record (also written to its file)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    path = os.path.join(folder, f"rank{rank}_attempt{attempt}.json")
    rec = {"rank": rank, "attempt": attempt, "pid": os.getpid(), "threads": torch.get_num_threads(),
           "resumed_from": 0, "steps": [], "losses": [], "ended": "running",
           "started_at": time.time()}  # after init_process_group: the group is up
    signal.signal(signal.SIGTERM, lambda *_: (_write(path, dict(rec, ended="SIGTERM")), os._exit(143)))
    model, opt = ft.make_model()
    snap = ft.latest(os.path.join(folder, "ckpt"))
    if snap:
        rec["resumed_from"] = ft.restore(model, opt, snap)[0]
    _write(path, rec)
    for s in range(rec["resumed_from"], steps):
        try:
            rec["losses"].append(ft.step(model, opt, s, rank, world_size))
        except RuntimeError as exc:  # on gloo a survivor's collective fails when its peer's socket closes
            rec["collective_error"] = str(exc).splitlines()[0].split("] ")[-1][:120]
            _write(path, rec)
            # Wait for the agent's SIGTERM instead of exiting: a survivor that died on its own within
            # one monitor interval of the kill would be reaped in the same poll, and the agent would
            # log whichever of the two failures it ranked first, not necessarily the SIGKILL.
            time.sleep(60)
            raise
        rec["steps"].append(s)
        if rank == 0 and (s + 1) % every == 0:
            ft.save(os.path.join(folder, "ckpt"), ft.state(model, opt, s + 1, s + 1))
        if attempt == 0 and rank == kill_rank and s + 1 == kill_step:
            _write(path, dict(rec, ended="SIGKILL", killed_at=time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no handler, no cleanup, no goodbye
        _write(path, rec)
    rec.update(weights=_weights(model), reference=uninterrupted(rank, world_size, steps), ended="finished")
    _write(path, rec)
    return rec


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("One worker of the elastic-restart lab; run it under torchrun "
                   "(python -m labs.failures.elastic starts torchrun for you).", world_size_default=None)
    p.add_argument("--folder", required=True, help="where the checkpoints and the per-rank records go")
    p.add_argument("--steps", type=cli.positive_int, default=8)
    p.add_argument("--every", type=cli.positive_int, default=3, help="checkpoint every this many steps")
    p.add_argument("--kill-step", type=cli.positive_int, default=5,
                   help="attempt 0 dies after this many steps")
    p.add_argument("--kill-rank", type=int, default=1)
    args = cli.parse(p, argv)
    if not cli.under_torchrun():
        raise ValueError("this script is a torchrun worker; run python -m labs.failures.elastic instead.")
    torch.set_num_threads(1)  # as the spawned ranks of every other lab: the reference's bits depend on it
    os.makedirs(os.path.join(args.folder, "ckpt"), exist_ok=True)
    dist.init_process_group("gloo", store=attempt_store(), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    try:
        rec = work(args.folder, args.steps, args.every, args.kill_step, args.kill_rank)
    finally:
        dist.destroy_process_group()
    cli.report({k: rec[k] for k in ("rank", "attempt", "resumed_from", "steps")}, args,
               f"attempt {rec['attempt']}: resumed from step {rec['resumed_from']}, ran steps {rec['steps']}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
