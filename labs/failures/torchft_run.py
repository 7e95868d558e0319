"""Chapter 13: per-step fault tolerance with torchft, run for real: a replica group killed mid-step
while the others keep training, restarted, healed from a live peer.

torchft (github.com/pytorch/torchft, 0.2.0) keeps a data-parallel job running through the loss of
a replica group. A lighthouse forms a quorum of the groups that ask for one every step; each
group's ``Manager`` reconfigures its gloo process group to the quorum, averages gradients over
the groups that take part, and lets the optimizer step only if ``should_commit`` agrees that the
step went through everywhere (torchft/manager.py). A group that joins behind the others is sent
the weights and optimizer state of a live one (the lighthouse's quorum names who sends to whom:
src/manager.rs, ``compute_quorum_results``).

The lab starts a lighthouse and three replica groups (`labs.failures.torchft_replica`, one
process each), lets them train the tiny GPT, SIGKILLs one group in the middle of a step from
outside, starts it again (what torchelastic would do for a real group), and reads every figure
from the processes' own logs. It also runs the same job without the kill (the reference), with
its lighthouse killed after the last step: a fault torchft does not survive; and the kill once
more with torchft's own ``DistributedDataParallel``, whose survivor does not survive it on gloo
in 0.2.0 (see `labs.failures.torchft_replica`).

    python -m labs.failures.torchft_run --json
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPLICAS = 3
# The uninterrupted run: its steps need no sleep (no kill to aim at, no timeline drawn from it), and
# after its lighthouse is killed each replica's quorum request times out in QUORUM_TIMEOUT_S.
REFERENCE_STEP_S, QUORUM_TIMEOUT_S = 0.1, 2.0


class Job:
    """The processes of one run: a lighthouse and the replica groups, every PID kept."""

    def __init__(self, folder, steps, step_s, deadline, wrapper, replicas, replica_timeout_s,
                 quorum_timeout_s=None):
        self.folder, self.steps, self.step_s, self.deadline = folder, steps, step_s, deadline
        self.wrapper, self.replicas, self.replica_timeout_s = wrapper, replicas, replica_timeout_s
        self.quorum_timeout_s = quorum_timeout_s
        self.procs, self.pids = {}, []
        self.lighthouse = self._start(["--serve-lighthouse"], "lighthouse")
        self.address = self.wait_file("lighthouse")["address"]

    def _start(self, args, name):
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
        err = open(os.path.join(self.folder, f"{name}.stderr"), "ab")
        proc = subprocess.Popen([sys.executable, "-m", "labs.failures.torchft_replica", "--folder",
                                 self.folder, *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err)
        err.close()
        self.pids.append(proc.pid)
        return proc

    def start_replica(self, i):
        args = ["--replica", str(i), "--lighthouse", self.address, "--steps", str(self.steps),
                "--step-s", str(self.step_s), "--ready", str(self.replicas),
                "--timeout", str(self.replica_timeout_s)]
        if self.quorum_timeout_s:
            args += ["--quorum-timeout", str(self.quorum_timeout_s)]
        self.procs[i] = self._start(args + ["--ddp-wrapper"] * self.wrapper, f"replica{i}")
        return self.procs[i]

    def wait_file(self, name):
        path = os.path.join(self.folder, name)
        while not os.path.exists(path):
            self.check_time(f"waiting for {name}")
            time.sleep(0.05)
        with open(path) as f:
            return json.load(f) if name == "lighthouse" else f.read()

    def check_time(self, what):
        if time.monotonic() > self.deadline:
            raise RuntimeError(f"the torchft run did not finish in time ({what}); every process was killed.")

    def wait_all(self):
        """Wait for every replica to exit; returns when each was seen gone (a timing)."""
        ended = {}
        while len(ended) < len(self.procs):
            for i, p in self.procs.items():
                if i not in ended and p.poll() is not None:
                    ended[i] = time.time()
            self.check_time("replicas running")
            time.sleep(0.05)
        return ended

    def stop(self):
        """Kill whatever is left (each process by its PID) and reap it: no process outlives the run."""
        for p in [self.lighthouse, *self.procs.values()]:
            if p.poll() is None:
                p.kill()
            p.wait()


def alive(pids):
    """The PIDs in ``pids`` still running (a zombie has exited): none, once a run has returned."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


def read_log(folder, i):
    with open(os.path.join(folder, f"replica{i}.jsonl")) as f:
        return [json.loads(line) for line in f]


def run(steps=30, kill_replica=None, kill_step=8, step_s=0.3, kill_lighthouse_after=None,
        timeout=600.0, wrapper=False, replicas=REPLICAS, replica_timeout_s=15, restart=True,
        quorum_timeout_s=None):
    """One run of ``replicas`` groups. With ``kill_replica``, that group is SIGKILLed in the middle of
    step ``kill_step`` (inside the all-reduce, its peers waiting on it) and, if ``restart``, started
    again; ``wrapper`` trains with torchft's DistributedDataParallel instead; with
    ``kill_lighthouse_after``, the lighthouse is SIGKILLed once replica 0 has finished that step
    (the replicas are then asked for as many steps again)."""
    folder = tempfile.mkdtemp(prefix="labs-torchft-")
    target = steps if kill_lighthouse_after is None else 2 * steps
    job = Job(folder, target, step_s, time.monotonic() + timeout, wrapper, replicas, replica_timeout_s,
              quorum_timeout_s)
    events, state = {}, None
    try:
        if kill_replica is not None:
            with open(os.path.join(folder, f"arm{kill_step}"), "w") as f:
                f.write(str(kill_replica))
        for i in range(replicas):
            job.start_replica(i)
        if kill_replica is not None:
            for i in range(replicas):  # every replica is at the all-reduce of step kill_step
                job.wait_file(f"reduce{i}_{kill_step}")
            time.sleep(0.5)            # the survivors are inside it, blocked on the victim
            victim = job.procs[kill_replica]
            os.kill(victim.pid, signal.SIGKILL)
            events["kill"] = {"time": time.time(), "pid": victim.pid}
            victim.wait()
            events["kill"]["returncode"] = victim.returncode
            os.remove(os.path.join(folder, f"arm{kill_step}"))
            if restart:
                events["restart"] = {"time": time.time()}
                job.start_replica(kill_replica)  # what torchelastic would do for a real replica group
            state = {i: torch.load(os.path.join(folder, f"state{i}_{kill_step}.pt"))  # the survivors'
                     for i in range(replicas) if i != kill_replica}
        if kill_lighthouse_after is not None:
            while not any(e.get("step", -1) >= kill_lighthouse_after for e in _safe_log(folder, 0)):
                job.check_time("waiting for the step before the lighthouse is killed")
                time.sleep(0.05)
            os.kill(job.lighthouse.pid, signal.SIGKILL)
            events["lighthouse_kill"] = {"time": time.time(), "pid": job.lighthouse.pid}
        events["ended"] = job.wait_all()
        logs = {i: read_log(folder, i) for i in range(replicas)}
        codes = {i: p.returncode for i, p in job.procs.items()}
        stderr = {i: _tail(os.path.join(folder, f"replica{i}.stderr")) for i in range(replicas)}
    finally:
        job.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return {"logs": logs, "events": events, "returncodes": codes, "stderr": stderr, "pids": job.pids,
            "state_before_kill": state, "steps": steps, "kill_step": kill_step, "replicas": replicas}


def _safe_log(folder, i):
    try:
        return read_log(folder, i)
    except (OSError, ValueError):
        return []


def _tail(path, n=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""




def lighthouse_lost(run_):
    """What the replicas did after the lighthouse was killed: the steps they still committed, the
    error each ended with (from its own log) and how long after the kill it was gone."""
    kill = run_["events"]["lighthouse_kill"]["time"]
    out = {}
    for i, log in run_["logs"].items():
        after = [e["step"] for e in log if e["event"] == "step" and e["committed"] and e["started"] > kill]
        failed = [e for e in log if e["event"] == "failed"]
        out[i] = {"steps_after": after, "error": failed[0]["error"] if failed else None,
                  "gone_s": run_["events"]["ended"][i] - kill, "returncode": run_["returncodes"][i]}
    return out


def torchft(steps=30, kill_step=8, step_s=0.3, kill_replica=2, timeout=600.0, noise_runs=2,
            wrapper_check=True):
    """The uninterrupted run (its lighthouse killed after the last step), the run with a replica
    group killed mid-step and restarted, what the logs say, and the replay's checks."""
    from labs.failures import torchft_check as check
    if not 0 < kill_step < steps - 4:
        raise ValueError(f"--kill-step {kill_step} must leave steps before it and at least 4 after it "
                         f"(--steps {steps}).")
    if not 0 <= kill_replica < REPLICAS:
        raise ValueError(f"--kill-replica {kill_replica} is not one of the {REPLICAS} replica groups.")
    with ThreadPoolExecutor(1) as pool:  # the wrapper's job (no timings read) beside the reference's
        wrapper = pool.submit(ddp_wrapper, step_s, timeout) if wrapper_check else None
        reference = run(steps, step_s=min(step_s, REFERENCE_STEP_S), kill_lighthouse_after=steps - 1,
                        timeout=timeout, replica_timeout_s=5, quorum_timeout_s=QUORUM_TIMEOUT_S)
        wrapper = wrapper.result() if wrapper else None
    pids = reference["pids"] + (wrapper["pids"] if wrapper else [])
    for attempt in (0, 1):  # a run in which a survivor was left out of a quorum is refused, once
        fault = run(steps, kill_replica=kill_replica, kill_step=kill_step, step_s=step_s, timeout=timeout)
        pids += fault["pids"]
        try:
            summary = check.summarize(fault, reference)
            break
        except RuntimeError:
            if attempt:
                raise
    survivor = summary["survivor"]
    exact = check.replay_exact(summary, fault["state_before_kill"][survivor], fault["logs"][survivor])
    out = {"summary": summary, "replay_exact": exact, "trajectory": check.trajectory(summary, noise_runs),
           "lighthouse_lost": lighthouse_lost(reference), "pids": pids, "fault_attempts": attempt + 1,
           "fault_logs": fault["logs"], "fault_events": fault["events"]}  # for the sequence diagram
    if wrapper:
        out["ddp_wrapper"] = wrapper
    return out


def ddp_wrapper(step_s=0.3, timeout=600.0):
    """The same kill with torchft's own DistributedDataParallel, two replica groups, no restart:
    does the survivor carry on?"""
    r = run(10, kill_replica=1, kill_step=3, step_s=step_s, timeout=timeout, wrapper=True, replicas=2,
            restart=False)
    failed = [e for e in r["logs"][0] if e["event"] == "failed"]
    return {"survivor_returncode": r["returncodes"][0], "survivor_error": failed[0]["error"] if failed
            else None,
            "in_ddp_hook": "assert fut._fut" in r["stderr"][0] and "torchft/ddp.py" in r["stderr"][0],
            "survivor_steps": sorted({e["step"] for e in r["logs"][0] if e["event"] == "step"
                                      and e["committed"]}),
            "pids": r["pids"]}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Kill one of three torchft replica groups mid-step and watch the others carry on, "
                   "the killed one heal from a live peer; then kill the lighthouse.", world_size_default=None)
    p.add_argument("--steps", type=cli.at_most(200, "a short run"), default=30)
    p.add_argument("--kill-step", type=cli.positive_int, default=8)
    p.add_argument("--kill-replica", type=int, default=2)
    args = cli.parse(p, argv)
    if args.world_size not in (None, REPLICAS):
        raise ValueError(f"--world-size {args.world_size}: the lab runs {REPLICAS} replica groups of "
                         "one process.")
    r = torchft(args.steps, args.kill_step, kill_replica=args.kill_replica, timeout=args.timeout * 5)
    s = r["summary"]
    cli.report(r, args, f"step {s['turned_down']} turned down; {len(s['small_quorum_steps'])} steps with "
               f"{s['small_quorum_size']} replicas; new quorum {s['new_quorum_s']:.1f} s after the kill; "
               f"replica {s['victim']} recovered {s['recovered_bytes']:,} bytes at step "
               f"{s['recovered_step']} and rejoined at step {s['rejoined_step']}; replicas agree bit for "
               f"bit: {s['replicas_agree']}; "
               f"lighthouse killed: every replica stopped: "
               f"{all(v['returncode'] != 0 for v in r['lighthouse_lost'].values())}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
