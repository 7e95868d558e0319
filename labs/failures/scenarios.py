"""Chapter 13: failures at scale, injected into real processes, detected and recovered from.

Five scenarios, each on the tiny DDP job of `labs.failures.fault_training`:

- hang: one rank stops in its own code (a stuck data loader) while its peers wait in the gradient
  all-reduce; the launcher's heartbeat names it at the timeout, `monitored_barrier` within seconds.
- kill: a supervisor SIGKILLs one rank from outside mid-training and restarts the job from the
  latest checkpoint; the final loss equals an uninterrupted run's, bit for bit.
- sdc / loss-spike: see `labs.failures.silent_faults` (a flipped bit, a bad batch).
- straggler: see `labs.failures.stragglers` (one rank sleeps every step; all-gathered compute times name it).

Each returns a result dict with at least detected, detected_rank, seconds_to_detect, steps_lost,
final_loss_match, and the PIDs of every rank it started (the tests check none survives).
"""
import datetime
import os
import re
import shutil
import signal
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from labs.failures import fault_training as ft
from labs.launcher import launch
from labs.failures import silent_faults, stragglers

SCENARIOS = ("hang", "kill", "sdc", "loss-spike", "straggler")


def _write(folder, name, text):
    with open(os.path.join(folder, name + ".tmp"), "w") as f:
        f.write(str(text))
    os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))


def _read(folder, name):
    try:
        with open(os.path.join(folder, name)) as f:
            return f.read()
    except OSError:
        return None


def _pids(folder, world_size):
    return [int(_read(folder, f"pid{r}")) for r in range(world_size) if _read(folder, f"pid{r}")]


# --- hang -------------------------------------------------------------------------------------

def _stuck_loading_data(folder):
    _write(folder, "hung_at", time.time())
    while True:  # e.g. a read from a dead file system: busy in its own code, no collective
        time.sleep(0.1)


@launch.on_cpu("it only reports its process id, the first start of the CPU-only fault scenarios")
def ready(rank, world_size):
    return os.getpid()


def _record_flight(folder, rank):
    """torch's flight recorder, dumped a few times a second by a thread (a hung main thread cannot
    dump): the last collective this rank entered, by name and sequence number."""
    import json
    from torch._C._distributed_c10d import _dump_fr_trace_json
    while True:
        entries = json.loads(_dump_fr_trace_json(True, True)).get("entries", [])
        last = entries[-1] if entries else {}
        _write(folder, f"fr{rank}", json.dumps([last.get("profiling_name"), last.get("collective_seq_id")]))
        time.sleep(0.2)


def _stuck_in_recv(folder, rank, world_size, group):
    _write(folder, "hung_at", time.time())
    t = torch.empty(1)
    dist.recv(t, src=(rank + 1) % world_size, group=group)  # a message its peer never sends


@launch.on_cpu("dist.monitored_barrier exists only on gloo, and the flight recorder is read as gloo "
               "writes it")
def hang_rank(rank, world_size, folder, hang_rank_, hang_step, barrier_s=None, inside=False):
    """Train; rank ``hang_rank_`` hangs before step ``hang_step``: in its own code, or ``inside`` a
    recv whose send never comes (the others wait in the all-reduce). With ``barrier_s``, every step
    starts with ``dist.monitored_barrier`` (rank 0 names the rank that did not arrive in time);
    without, the flight recorder is dumped. It is on by default; TORCH_FR_BUFFER_SIZE would have to
    be set before the launcher's init_process_group, since each process reads it once, when its
    recorder is first used (making the first group), so it is left at its default of 2,000 entries."""
    _write(folder, f"pid{rank}", os.getpid())
    group = None
    if not barrier_s:
        group = dist.new_group(list(range(world_size)))
        threading.Thread(target=_record_flight, args=(folder, rank), daemon=True).start()
    model, opt = ft.make_model()
    for step in range(hang_step + 2):
        if rank == hang_rank_ and step == hang_step:
            _stuck_in_recv(folder, rank, world_size, group) if inside else _stuck_loading_data(folder)
        if barrier_s:
            try:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=barrier_s))
            except RuntimeError as exc:  # rank 0 names the late rank; its peers only see rank 0 go
                _write(folder, f"barrier_error{rank}", f"{time.time()} {exc}")
                raise
        ft.step(model, opt, step, rank, world_size, group=group)


def hang(world_size=3, hang_rank_=1, hang_step=3, timeout=5.0, barrier_s=1.0, inside=False):
    """Two runs of the same hang: caught at the watchdog's ``timeout`` by the launcher's heartbeat
    (each rank's collective) and the flight recorder (each rank's last collective), then by
    monitored_barrier after ``barrier_s``. The rank named: the heartbeat's culprit; if every rank
    is inside a collective, the one whose collective differs; else the one the recorder shows behind."""
    out, pids = {}, []
    launch.spawn(ready, world_size, timeout=60)  # start-up (importing torch) must not eat the watchdog
    for way in ("heartbeat", "monitored_barrier"):
        folder = tempfile.mkdtemp(prefix="labs-hang-")
        try:
            try:
                launch.spawn(hang_rank, world_size, folder, hang_rank_, hang_step,
                             barrier_s if way == "monitored_barrier" else None, inside, timeout=timeout)
                raise AssertionError("the hung run finished")
            except launch.RankError as exc:
                caught, error = time.time(), exc
            pids += _pids(folder, world_size)
            hung_at = float(_read(folder, "hung_at"))
            if way == "heartbeat":
                out[way] = _heartbeat_verdict(error, world_size, caught - hung_at)
                out["flight_recorder"] = _recorder_verdict(folder, world_size)
            else:
                out[way] = _barrier_verdict(_read(folder, "barrier_error0"), hung_at)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    hb, fr = out["heartbeat"], out["flight_recorder"]
    named = hb["rank"] if hb["rank"] is not None else fr["rank"]
    return {"scenario": "hang", "world_size": world_size, "injected_rank": hang_rank_, "inside": inside,
            "detected": named is not None, "detected_rank": named,
            "seconds_to_detect": hb["seconds"], "steps_lost": None, "final_loss_match": None,
            "collectives": hb["collectives"], "heartbeat": hb, "monitored_barrier": out["monitored_barrier"],
            "flight_recorder": out["flight_recorder"],
            "timeout_s": timeout, "barrier_s": barrier_s, "pids": pids}


def _heartbeat_verdict(error, world_size, seconds):
    """The rank the launcher named at the timeout and, from its message, each rank's collective.

    When every rank is inside some collective the launcher names none (a deadlock); the rank
    whose collective differs from all the others' is then the suspect, if there is exactly one."""
    text = str(error)
    head = text.splitlines()[0]
    if not isinstance(error, launch.RankTimeout):
        return {"rank": None, "seconds": seconds, "collectives": None, "how": head}
    if error.culprits:
        waited = re.search(r"waited for it in ([\w, ]+)\)", text)
        collectives = {r: (None if r in error.culprits else waited.group(1) if waited else "?")
                       for r in range(world_size)}
        return {"rank": error.culprits[0], "seconds": seconds, "collectives": collectives, "how": head}
    found = re.search(r"ranks (.*?) of \d+ did not finish", head)
    collectives = {int(r): c for r, c in re.findall(r"(\d+) in (\w+)", found.group(1))} if found else {}
    odd = [r for r, c in collectives.items() if list(collectives.values()).count(c) == 1]
    rank = odd[0] if len(odd) == 1 and len(collectives) > 2 else None
    return {"rank": rank, "seconds": seconds, "collectives": collectives, "how": head}


def _recorder_verdict(folder, world_size):
    """Each rank's last collective from its flight-recorder dump; the rank behind is named."""
    import json
    last = {r: json.loads(_read(folder, f"fr{r}") or "[null, null]") for r in range(world_size)}
    seqs = {r: seq or 0 for r, (_, seq) in last.items()}
    behind = [r for r in seqs if seqs[r] < max(seqs.values())]
    return {"rank": behind[0] if len(behind) == 1 else None, "last": last}


def _barrier_verdict(record, hung_at):
    """The rank rank 0's monitored_barrier named, and how long after the hang it raised."""
    if record is None:
        return {"rank": None, "seconds": None, "how": "rank 0's monitored_barrier did not raise"}
    when, message = record.split(" ", 1)
    found = re.search(r"Rank (\d+) failed to pass monitoredBarrier", message)
    return {"rank": int(found.group(1)) if found else None, "seconds": float(when) - hung_at,
            "how": message.splitlines()[0][:160]}


# --- kill and restart -------------------------------------------------------------------------

@launch.on_cpu(ft.ON_CPU)
def train_with_checkpoints(rank, world_size, folder, steps, every, step_s=0.0):
    """DDP training that resumes from the latest checkpoint in ``folder`` and saves one every
    ``every`` steps (rank 0: the model is replicated). Reports its progress after every step."""
    _write(folder, f"pid{rank}", os.getpid())
    model, opt = ft.make_model()
    snap = ft.latest(folder)
    start = ft.restore(model, opt, snap)[0] if snap else 0
    started, loss = time.time(), None   # the group is up and the checkpoint loaded: training again
    for step in range(start, steps):
        loss = ft.step(model, opt, step, rank, world_size)
        if rank == 0 and (step + 1) % every == 0:
            ft.save(folder, ft.state(model, opt, step + 1, step + 1))
        _write(folder, f"progress{rank}", step + 1)
        time.sleep(step_s)  # slow enough for the killer to land mid-training
    return {"loss": loss, "start": start, "started": started, "pid": os.getpid()}


def _killer(folder, rank, after, record, deadline):
    """From outside the job: SIGKILL ``rank`` once it has finished ``after`` steps."""
    while time.monotonic() < deadline:
        done, pid = _read(folder, f"progress{rank}"), _read(folder, f"pid{rank}")
        if done and pid and int(done) >= after:
            os.kill(int(pid), signal.SIGKILL)
            record.update(time=time.time(), pid=int(pid), at_step=int(done))
            return
        time.sleep(0.01)


def kill(world_size=2, kill_rank=1, steps=12, every=4, kill_after=6, step_s=0.05, timeout=60.0):
    """Uninterrupted run; run killed by SIGKILL after ``kill_after`` steps; restart from the
    latest checkpoint. Steps lost = steps done before the kill - the step the restart resumed at."""
    folders = [tempfile.mkdtemp(prefix="labs-kill-") for _ in range(2)]
    try:
        clean = launch.spawn(train_with_checkpoints, world_size, folders[0], steps, every, timeout=timeout)
        record, f = {}, folders[1]
        t = threading.Thread(target=_killer, args=(f, kill_rank, kill_after, record,
                                                   time.monotonic() + timeout))
        t.start()
        try:
            launch.spawn(train_with_checkpoints, world_size, f, steps, every, step_s, timeout=timeout)
            raise AssertionError("the run with a killed rank finished")
        except launch.RankError as exc:
            caught, error = time.time(), exc
        t.join(timeout)
        pids = _pids(folders[0], world_size) + _pids(f, world_size)
        reached = max(int(_read(f, f"progress{r}") or 0) for r in range(world_size))
        resumed = launch.spawn(train_with_checkpoints, world_size, f, steps, every, timeout=timeout)
        pids += _pids(f, world_size)
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    start = resumed[0]["start"]
    return {"scenario": "kill", "world_size": world_size, "injected_rank": kill_rank,
            "detected": True, "detected_rank": error.rank, "error": str(error).splitlines()[0],
            "seconds_to_detect": caught - record["time"], "killed_at_step": record["at_step"],
            "steps_reached": reached, "resumed_at_step": start, "steps_lost": reached - start,
            "checkpoint_every": every, "final_loss": resumed[0]["loss"], "clean_final_loss": clean[0]["loss"],
            "final_loss_match": resumed[0]["loss"] == clean[0]["loss"], "pids": pids,
            # a timing: from the SIGKILL until every rank of the restarted job was training again
            "restart_s": max(r["started"] for r in resumed) - record["time"],
            "processes_restarted": len({r["pid"] for r in resumed})}


RUNNERS = {"hang": hang, "kill": kill, "straggler": stragglers.straggler,
           "sdc": silent_faults.sdc, "loss-spike": silent_faults.loss_spike}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Inject one fault into a small DDP job and report how it was detected.", 3)
    p.add_argument("--scenario", choices=SCENARIOS, required=True)
    p.add_argument("--rank", type=int, default=1,
                   help="the rank the fault is injected on (default 1; loss-spike: a bad batch reaches "
                   "every rank); for hang, --timeout is the watchdog, at most 5 s")
    args = cli.parse(p, argv)
    if args.world_size < 2:
        raise ValueError(f"--world-size {args.world_size} has no peer to detect a fault; use 2 or more.")
    if not 0 <= args.rank < args.world_size:
        raise ValueError(f"--rank {args.rank} is not a rank of {args.world_size}; "
                         f"pick 0 to {args.world_size - 1}.")
    if args.scenario == "hang" and args.rank == 0:
        raise ValueError("--rank 0 hosts monitored_barrier's check; inject the hang on rank 1 or above.")
    key = {"hang": "hang_rank_", "kill": "kill_rank", "straggler": "slow_rank"}.get(args.scenario, "bad_rank")
    timeout = min(args.timeout, 5.0) if args.scenario == "hang" else args.timeout  # hang: the watchdog
    result = RUNNERS[args.scenario](world_size=args.world_size, timeout=timeout, **{key: args.rank})
    secs = result["seconds_to_detect"]
    cli.report(result, args, f"{args.scenario} on rank {args.rank} of {args.world_size}: detected "
               f"{result['detected']} (rank {result['detected_rank']}) after "
               f"{'-' if secs is None else f'{secs:.2f}'} s; "
               f"steps lost {result['steps_lost']}; final loss match {result['final_loss_match']}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
