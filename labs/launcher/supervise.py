"""The launcher's side of a spawned run (see labs.launcher.launch): wait for the ranks, name the one that
failed or hung, stop them all, and replay their output in rank order.

Each rank leaves files in the run's folder (`path`): its stdout and stderr, a heartbeat
(`labs.launcher.heartbeat`), and at the end a result or an error record.
"""
import json
import os
import signal
import subprocess
import time

from labs.launcher import heartbeat


class RankError(RuntimeError):
    """A rank raised or died. ``rank`` is the first rank that failed."""

    def __init__(self, message, rank):
        super().__init__(message)
        self.rank = rank


class RankTimeout(RankError):
    """Some ranks did not finish within the timeout. ``ranks`` lists them; ``culprits`` the ones the
    others waited for, and ``rank`` the first of those (the first of ``ranks`` if none is known)."""

    def __init__(self, message, ranks, culprits=()):
        super().__init__(message, (list(culprits) or list(ranks))[0])
        self.ranks, self.culprits = list(ranks), list(culprits)


def path(tmp, rank, kind):
    return os.path.join(tmp, f"rank{rank}.{kind}")


def write_json(path, record):
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # the parent polls: never half a file


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def wait(procs, tmp, deadline, grace=2.0, symptom_grace=10.0):
    """Wait until every rank exits, one fails, or the deadline passes.

    After the first failure the others get ``grace`` seconds to report theirs, so that the cause,
    not a peer that merely lost its connection to it, can be named; ``symptom_grace`` while every
    failure seen is only such a symptom. A peer sees the broken connection at once, in gloo's own
    thread, while the rank that broke it is still formatting its traceback: on a starved machine
    that takes seconds.
    """
    pending = set(range(len(procs)))
    failures = {}  # rank -> error record
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        for r in sorted(pending):
            if r not in failures and os.path.exists(path(tmp, r, "error")):
                failures[r] = read_json(path(tmp, r, "error"))
            code = procs[r].poll()
            if code is None:
                continue
            pending.discard(r)
            if r not in failures and (code != 0 or not os.path.exists(path(tmp, r, "result"))):
                failures[r] = {"time": _last_sign_of_life(tmp, r), "type": "died", "phase": "run",
                               "traceback": "", "message": _exit_reason(code)}
        if failures:
            causes = [f for f in failures.values() if not _only_symptom(f)]
            deadline = min(deadline, time.monotonic() + (grace if causes else symptom_grace))
            if all(r in failures for r in pending):
                break
    return sorted(pending), [(record, r) for r, record in failures.items()]


def _only_symptom(record):
    record = record or {}
    return record.get("type") != "died" and heartbeat.is_symptom(record.get("message"))


def _last_sign_of_life(tmp, rank):
    """When a rank that died was last seen alive: its last heartbeat or log write, whichever is
    later. We notice a death only when we poll, after its peers may have reported the broken
    connection; the death came before that, and after these."""
    times = [os.path.getmtime(path(tmp, rank, kind)) for kind in ("stdout", "stderr")
             if os.path.exists(path(tmp, rank, kind))]
    beat = heartbeat.read_beat(path(tmp, rank, "beat"))
    times += [beat["time"]] if beat else []
    return max(times) if times else time.time()


def _exit_reason(code):
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code} without returning a result"


def _tail(path, lines=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def rank_error(failures, world_size, tmp):
    """Name the cause: a rank that died or raised its own error, the earliest first; the ranks
    whose error only says that a peer went away come last, whatever their time."""
    failures.sort(key=lambda item: (_only_symptom(item[0]), item[0]["time"]))
    record, rank = failures[0]
    if record["type"] == "died":
        head = f"rank {rank} of {world_size} {record['message']}"
        detail = _tail(path(tmp, rank, "stderr"))
    elif record["phase"] == "start":
        head = (f"rank {rank} of {world_size} failed to start: {record['type']}: {record['message']} (a rank "
                "imports the function's module afresh: it must import without error in a new process)")
        detail = record["traceback"]
    else:
        head = f"rank {rank} of {world_size} raised {record['type']}: {record['message']}"
        detail = record["traceback"]
    others = ", ".join(str(r) for _, r in failures[1:])
    also = f"\n(ranks {others} failed after it)" if others else ""
    return RankError(f"{head}{also}\n\n--- rank {rank} ---\n{detail}", rank)


def timeout_error(procs, unfinished, world_size, timeout, tmp):
    """Name the ranks the others waited for, from their heartbeats; show every stuck rank's stack."""
    now = time.time()
    beats = {r: heartbeat.read_beat(path(tmp, r, "beat")) for r in unfinished}
    for r in unfinished:  # SIGUSR1 -> faulthandler writes the rank's stack to its stderr
        if hasattr(signal, "SIGUSR1") and procs[r].poll() is None:
            procs[r].send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    stacks = "\n".join(f"--- rank {r} was here ---\n{_tail(path(tmp, r, 'stderr'), 25)}" for r in unfinished)
    head = heartbeat.timeout_message(beats, unfinished, world_size, timeout, now)
    culprits, _ = heartbeat.verdict(beats, unfinished, now)
    return RankTimeout(f"{head}\n\n{stacks}", unfinished, sorted(culprits))


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def replay_stdout(tmp, world_size, keep=10_000):
    """Print what each rank printed, in rank order, so notebooks show a deterministic log."""
    for r in range(world_size):
        with open(path(tmp, r, "stdout"), errors="replace") as f:
            lines = f.read().splitlines()
        if len(lines) > keep:
            print(f"[rank {r}] ({len(lines) - keep:,} earlier lines of {len(lines):,} not shown)")
        for line in lines[-keep:]:
            print(f"[rank {r}] {line}")
