"""Start ranks by forking a process that has already imported torch (the launcher's side).

A rank that starts as a fresh interpreter spends about 2 s of CPU importing torch before it does
any work, and a lab of a few milliseconds pays that on every rank of every call: on a 2-core
machine most of a notebook's run. So the launcher keeps one *zygote* per process
(``python labs/launcher/_rank.py --zygote PID``, see labs/launcher/_rank.py): it imports torch once,
then forks a rank per request. The fork has imported nothing of the caller's: it imports the lab's module
afresh, sees the caller's current working directory, ``sys.path`` and environment (a change in a variable that
libraries read when imported, `IMPORT_TIME`, starts a new zygote), and runs exactly the code a fresh rank
runs. Forking is safe here because
the zygote only imports: it starts no thread pool and runs no kernel. The launcher forks gloo
ranks only; NCCL ranks start as fresh interpreters, since a process must not fork once CUDA has
been touched and only a fresh one is sure not to have been.

`Rank` is what the launcher holds for each rank: the slice of `subprocess.Popen` that
`labs.launcher.supervise` uses (``pid``, ``poll``, ``terminate``, ``kill``, ``wait``). The zygote reports
each exit code, since only a parent can reap its child.

Lifetimes: the zygote dies with the launcher process (parent-death signal, from a thread that lives
as long as the process, and end of its stdin), and every rank with the zygote. $LABS_ZYGOTE=0 starts
each rank as a fresh interpreter instead.
"""
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

ENV = "LABS_ZYGOTE"
_RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rank.py")
# Variables read while torch, its threading libraries or Python start: a zygote started under other
# values would give its ranks the old ones, so a change in any of these starts a new zygote.
IMPORT_TIME = ("TORCH", "ATEN_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "CUDA", "NCCL_", "GLOO_",
               "PYTHON", "LD_", "MALLOC", "NVIDIA_", "HIP_", "ROCR_")
_lock = threading.Lock()
_zygotes = []  # this process's zygotes, the one serving the current environment last
_ids = itertools.count()


def enabled():
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1") != "0"


class Zygote:
    def __init__(self):
        self.env, self.owner = _import_time_env(), os.getpid()
        self.proc = _in_keeper(lambda: subprocess.Popen(
            [sys.executable, _RANK_SCRIPT, "--zygote", str(os.getpid())], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True))
        self.pids, self.codes, self.live = {}, {}, set()  # request id -> pid; pid -> exit code
        self.changed, self.drained = threading.Condition(), threading.Event()
        self.ready = threading.Event()  # set once it has imported torch (or has died trying)
        threading.Thread(target=self._listen, name="labs-zygote", daemon=True).start()

    def _listen(self):
        for line in self.proc.stdout:
            record = json.loads(line)
            with self.changed:
                if "ready" in record:
                    self.ready.set()
                elif "id" in record:
                    self.pids[record["id"]] = record["pid"]
                    self.live.add(record["pid"])
                elif "code" in record:
                    self.codes[record["pid"]] = record["code"]
                    self.live.discard(record["pid"])
                self.changed.notify_all()
        self.proc.wait()
        with self.changed:
            self.ready.set()
            self.drained.set()
            self.changed.notify_all()

    def alive(self):
        return self.proc.poll() is None

    def start(self, tmp, rank):
        """Ask for a rank; it is forked once the zygote has imported torch (the first call waits)."""
        request = next(_ids)
        line = json.dumps({"id": request, "tmp": tmp, "rank": rank, "cwd": os.getcwd(),
                           "env": dict(os.environ)}) + "\n"
        with _lock:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        return Rank(self, request)

    def close(self):
        try:
            self.proc.stdin.close()  # end of input: the zygote kills what is left and exits
        except OSError:
            pass


class Rank:
    """A rank forked by a zygote, seen through the part of Popen's interface the launcher uses."""

    def __init__(self, zygote, request):
        self.zygote, self.request, self.returncode = zygote, request, None

    @property
    def pid(self):
        """None until the zygote has forked it."""
        return self.zygote.pids.get(self.request)

    def poll(self):
        if self.returncode is None:
            codes = self.zygote.codes
            if self.pid in codes:
                self.returncode = codes[self.pid]
            elif self.zygote.drained.is_set():  # the zygote is gone, and every rank of it it did not report
                self.returncode = -signal.SIGKILL  # died with it (parent-death signal)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None and self.pid is not None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self._stop(signal.SIGTERM)

    def kill(self):
        self._stop(signal.SIGKILL)

    def _stop(self, sig):
        if self.poll() is None and self.pid is None:  # not forked yet: only stopping the zygote stops it
            self.zygote.proc.kill()
        self.send_signal(sig)

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.zygote.changed:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"rank forked by zygote {self.zygote.proc.pid}", timeout)
                self.zygote.changed.wait(0.05 if left is None else min(left, 0.05))
        return self.returncode


def wait_ready(ranks, seconds):
    """Wait, at most ``seconds``, until the zygotes that fork ``ranks`` have imported torch.

    A new zygote imports torch before it forks its first rank: about 2 s of CPU, over a minute
    on 2 cores under a load average of 20. That is the launcher's start-up, paid once per
    process, not the run's: a run's timeout that counted it would fire on the first launch of a
    busy machine before any rank existed. So the launcher starts the run's clock after this."""
    deadline = time.monotonic() + seconds
    for zygote in {id(r.zygote): r.zygote for r in ranks if isinstance(r, Rank)}.values():
        zygote.ready.wait(max(0.0, deadline - time.monotonic()))


def _import_time_env():
    return {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME)}


def start_rank(tmp, rank):
    """A rank of the run in ``tmp``, forked by this process's zygote (started if needed)."""
    with _lock:
        current = _zygotes[-1] if _zygotes else None
        if (current is None or not current.alive() or current.env != _import_time_env()
                or current.owner != os.getpid()):
            for old in _zygotes:
                if old.owner == os.getpid() and not old.live:
                    old.close()
            _zygotes[:] = [z for z in _zygotes if z.owner == os.getpid() and z.live and z.alive()]
            current = Zygote()
            _zygotes.append(current)
    return current.start(tmp, rank)


def retire():
    """Close this process's zygotes (each ends once its ranks have): the next launch starts a new
    one, as the first launch of a process does (`labs.launcher.under_load` launches that way)."""
    with _lock:
        for old in _zygotes:
            if old.owner == os.getpid():
                old.close()
        _zygotes.clear()


# The kernel sends a child its parent-death signal when the *thread* that started it ends, so the
# zygote is started from a thread that lives as long as this process, whoever calls spawn.
_keeper_jobs = queue.Queue()
_keeper = None


def _keep():
    while True:
        job, answer = _keeper_jobs.get()
        try:
            answer.put((job(), None))
        except Exception as exc:
            answer.put((None, exc))


def _in_keeper(job):
    global _keeper
    if _keeper is None or not _keeper.is_alive():
        _keeper = threading.Thread(target=_keep, name="labs-zygote-keeper", daemon=True)
        _keeper.start()
    answer = queue.Queue()
    _keeper_jobs.put((job, answer))
    result, error = answer.get()
    if error is not None:
        raise error
    return result
