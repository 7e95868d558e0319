"""Chapter 13: elastic restart by torchrun itself, with a rank killed and the run resumed.

``torchrun --standalone --nproc-per-node=N --max-restarts=k`` starts one local elastic agent that
watches its N workers every ``--monitor-interval`` (0.1 s by default). When one of them fails,
its process context sends SIGTERM to the others (SIGKILL after a grace period) and reports the
failure; with restarts left the agent logs "Worker group FAILED. k/k attempts left; will restart
worker group", runs `_restart_workers` (stop, rendezvous again, start) and the new workers see
``TORCHELASTIC_RESTART_COUNT`` one higher; with none left it stops the group and torchrun exits
non-zero (torch 2.13: torch/distributed/run.py; elastic/agent/server/api.py `_invoke_run`,
`_restart_workers`; elastic/multiprocessing/api.py `_poll`, `_close`).

The lab runs `labs.failures.elastic_worker` under torchrun twice, with the same SIGKILL of one rank
on the first attempt: with ``--max-restarts=1`` (the group is restarted and resumes from the latest
checkpoint) and with ``--max-restarts=0`` (the job fails). Everything it reports is read from what
the workers wrote and what torchrun logged, not computed from the settings.

    python -m labs.failures.elastic --json
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

from labs.launcher import torchrun

# labs/<package>/<file>.py
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun_command(folder, world_size, max_restarts, steps, every, kill_step, kill_rank):
    """The command line: torchrun run by this interpreter, so the workers run the same torch."""
    return torchrun.command("--standalone", f"--nproc-per-node={world_size}",
                            f"--max-restarts={max_restarts}",
                            "-m", "labs.failures.elastic_worker", "--folder", folder, "--steps", str(steps),
                            "--every", str(every), "--kill-step", str(kill_step), "--kill-rank",
                            str(kill_rank))


def run_torchrun(cmd, timeout):
    """Run torchrun in its own session; past ``timeout`` the whole session is SIGKILLed (never hangs).

    LOGLEVEL=INFO makes the elastic agent print its restart decision (its logger's default is WARNING)."""
    env = torchrun.child_env(REPO, LOGLEVEL="INFO")
    env.pop("OMP_NUM_THREADS", None)  # torchrun then sets 1 per worker (run.py), as the lab's spawned ranks
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"torchrun did not finish within {timeout:g} s; its process group was "
                           "killed.") from None
    return {"returncode": proc.returncode, "log": log, "seconds": time.monotonic() - start}


def read_records(folder):
    """{(rank, attempt): record} from the workers' JSON files."""
    out = {}
    for path in glob.glob(os.path.join(folder, "rank*_attempt*.json")):
        with open(path) as f:
            rec = json.load(f)
        out[(rec["rank"], rec["attempt"])] = rec
    return out


def from_log(log):
    """What torchrun's agent said: each worker failure (exit code, local rank, pid), the SIGTERMs it
    sent, and its restart decisions."""
    failures = [{"exitcode": int(c), "local_rank": int(r), "pid": int(p)} for c, r, p in
                re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)", log)]
    sigterms = [int(p) for p in re.findall(r"Sending process (\d+) closing signal SIGTERM", log)]
    restarts = re.findall(r"Worker group FAILED\. (\d+)/(\d+) attempts left; will restart worker group", log)
    # the port of the TCPStore the workers bootstrap from, as the agent printed it for each attempt
    ports = [int(p) for p in re.findall(r"master_port=(\d+)", log)]
    return {"failures": failures, "sigterm_pids": sigterms, "restart_decisions": len(restarts),
            "store_ports": ports}


def one_run(world_size, max_restarts, steps, every, kill_step, kill_rank, timeout):
    folder = tempfile.mkdtemp(prefix="labs-elastic-")
    try:
        os.makedirs(os.path.join(folder, "ckpt"))
        cmd = torchrun_command(folder, world_size, max_restarts, steps, every, kill_step, kill_rank)
        ran = run_torchrun(cmd, timeout)
        recs = read_records(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    agent = from_log(ran["log"])
    return {"max_restarts": max_restarts, "returncode": ran["returncode"], "seconds": ran["seconds"],
            "attempts_seen": sorted({a for _, a in recs}), "records": recs, "agent": agent,
            "pids": sorted(r["pid"] for r in recs.values()), "log_tail": ran["log"][-3000:],
            "command": " ".join(["torchrun", *cmd[len(torchrun.command()):]]).replace(folder, "<folder>")}


def summarize(run, kill_rank, kill_step):
    """The facts the lab asserts, each read from the workers' records or the agent's log."""
    recs = run["records"]
    killed = recs.get((kill_rank, 0), {})
    failed = {f["pid"]: f["exitcode"] for f in run["agent"]["failures"]}
    out = {"max_restarts": run["max_restarts"], "returncode": run["returncode"],
           "attempts_seen": run["attempts_seen"], "restart_decisions": run["agent"]["restart_decisions"],
           "killed_rank_ended": killed.get("ended"), "killed_at_step": len(killed.get("steps", [])),
           # the agent's log names the killed worker's pid with exit code -9 (SIGKILL)
           "killed_exit_in_log": failed.get(killed.get("pid")),
           "survivors_stopped": {r: rec["ended"] for (r, a), rec in recs.items() if a == 0
                                 and r != kill_rank},
           # what a survivor's own collective said before the agent stopped it (None if it was stopped first)
           "survivors_saw": {r: rec.get("collective_error") for (r, a), rec in recs.items()
                             if a == 0 and r != kill_rank},
           "survivors_sigtermed": sorted(r for (r, a), rec in recs.items()
                                         if a == 0 and rec["pid"] in run["agent"]["sigterm_pids"]),
           "store_ports": run["agent"]["store_ports"],
           "seconds": run["seconds"], "command": run["command"], "pids": run["pids"]}
    if (kill_rank, 1) in recs:
        again = recs[(kill_rank, 1)]
        redone = sorted(set(killed["steps"]) & set(again["steps"]))  # steps both attempts ran
        finals = [recs[(r, 1)] for r in sorted(r for r, a in recs if a == 1)]
        out.update(resumed_from=again["resumed_from"], redone_steps=redone, steps_redone=len(redone),
                   # the redone steps recomputed the same losses as attempt 0 did
                   redone_losses_equal=[killed["losses"][killed["steps"].index(s)] for s in redone] ==
                   [again["losses"][again["steps"].index(s)] for s in redone],
                   final_weights_equal=all(f["weights"] == f["reference"]["weights"] for f in finals),
                   final_losses_equal=all(f["losses"] == f["reference"]["losses"][f["resumed_from"]:]
                                          for f in finals),
                   final_loss=finals[0]["losses"][-1], threads=sorted({f["threads"] for f in finals}),
                   # a timing: from the SIGKILL until every worker of attempt 1 had its process group
                   restart_s=max(f["started_at"] for f in finals) - killed["killed_at"])
    return out


def elastic(world_size=2, steps=8, every=3, kill_step=5, kill_rank=1, timeout=180.0, restarts=(1, 0)):
    """The same SIGKILL under ``torchrun --max-restarts`` for each value in ``restarts``."""
    if world_size < 2:
        raise ValueError(f"--world-size {world_size} has no survivor for torchrun to stop; use 2 or more.")
    if not 0 <= kill_rank < world_size:
        raise ValueError(f"--kill-rank {kill_rank} is not a rank of {world_size}.")
    if not every < kill_step < steps or kill_step % every == 0:
        raise ValueError(f"--kill-step {kill_step} must fall after a checkpoint, between two of them "
                         f"(not a multiple of --every {every}) and before --steps {steps}.")
    return {f"restarts_{k}": summarize(one_run(world_size, k, steps, every, kill_step, kill_rank, timeout),
                                       kill_rank, kill_step)
            for k in restarts}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Kill one rank of a torchrun job and watch torchrun --max-restarts restart it from "
                   "its checkpoint (and, with --max-restarts=0, fail).", world_size_default=2)
    p.add_argument("--steps", type=cli.at_most(50, "a handful of steps"), default=8)
    p.add_argument("--every", type=cli.positive_int, default=3,
                   help="checkpoint every this many steps (default 3)")
    p.add_argument("--kill-step", type=cli.positive_int, default=5,
                   help="rank --kill-rank dies after this step (default 5)")
    p.add_argument("--kill-rank", type=int, default=1)
    args = cli.parse(p, argv)
    if args.world_size > 4:
        raise ValueError(f"--world-size {args.world_size}: this lab runs at most 4 workers.")
    r = elastic(args.world_size, args.steps, args.every, args.kill_step, args.kill_rank, args.timeout)
    one, zero = r["restarts_1"], r["restarts_0"]
    cli.report(r, args, f"--max-restarts=1: attempts {one['attempts_seen']}, exit {one['returncode']}, "
               f"resumed from step {one.get('resumed_from')}, {one.get('steps_redone')} steps redone, final "
               f"weights equal an uninterrupted run's: {one.get('final_weights_equal')}; "
               f"--max-restarts=0: attempts {zero['attempts_seen']}, exit {zero['returncode']}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
