"""The launcher under faults, tried as a hostile user would: each case is run as its own command
with its own TMPDIR, and the test asserts the rank named, the time to report, that no process of
the run survives (every PID seen during the run is checked) and that no temporary file is left.

The faults come from `labs.launcher.launch --fault {raise,exit,kill,hang} --fault-rank R`: rank R fails
between two collectives while its peers wait for it in the second.
"""
import glob
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from labs.launcher import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
# Start-up (the parent's and the ranks' `import torch`) on a loaded 2-core machine; faults must be
# reported within their timeout plus this, and a failure that needs no timeout well before it.
START_S = 25


def _ours(tmpdir):
    """PIDs of the processes of one run: those whose environment names its TMPDIR."""
    needle = f"TMPDIR={tmpdir}".encode()
    pids = set()
    for env in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(env, "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.add(int(env.split("/")[2]))
        except OSError:  # gone, or not ours to read
            pass
    return pids


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


class Run:
    """A command run with its own TMPDIR, watched: every PID it starts is recorded as it appears."""

    def __init__(self, args, tmp_path, torchrun=False):
        self.tmpdir = str(tmp_path / "tmp")
        os.mkdir(self.tmpdir)
        env = dict(os.environ, TMPDIR=self.tmpdir, PYTHONPATH=REPO)
        cmd = [TORCHRUN, "--nproc_per_node=3"] if torchrun else [sys.executable]
        cmd += ["-m", "labs.launcher.hello"]
        self.start = time.monotonic()
        self.proc = subprocess.Popen(cmd + args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.seen, self._done = set(), threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self):
        while not self._done.is_set():
            # a new set, not |=: the test thread may be iterating over the old one
            self.seen = self.seen | (_ours(self.tmpdir) - {self.proc.pid})
            time.sleep(0.1)

    def ranks_started(self):
        return [p for p in self.seen if _alive(p) and b"_rank.py" in open(f"/proc/{p}/cmdline", "rb").read()]

    def finish(self, timeout=120):
        self.out, self.err = self.proc.communicate(timeout=timeout)  # returns only once every writer is gone
        self.seconds = time.monotonic() - self.start
        self._done.set()
        self._watcher.join()
        return self

    def left(self):
        """What the run left in its TMPDIR; torchrun's own log folder (torchelastic_*) is torchrun's
        to keep, as long as nothing of ours is in it."""
        found = []
        for name in os.listdir(self.tmpdir):
            if name.startswith("torchelastic_"):
                found += [p for p in glob.glob(os.path.join(self.tmpdir, name, "**", "*"), recursive=True)
                          if "labs" in os.path.basename(p)]
            else:
                found.append(name)
        return found

    def assert_clean(self, within=10):
        """Nothing of the run survives, and its TMPDIR is empty, within ``within`` seconds."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and (any(map(_alive, self.seen)) or self.left()):
            time.sleep(0.1)
        assert not [p for p in self.seen if _alive(p)], f"processes outlived the run: {self.seen}"
        assert self.left() == [], f"left behind: {self.left()}"
        assert self.seen, "the watcher saw no process of the run: it checked nothing"


def _headline(run):
    return run.err.split("error: ", 1)[-1].splitlines()[0]


@pytest.mark.parametrize("fault, rank, reason", [
    ("raise", 1, "raised RuntimeError: injected failure on rank 1"),
    ("exit", 1, "exited with code 3 without returning a result"),
    ("kill", 1, "was killed by signal SIGKILL"),
    ("raise", 0, "raised RuntimeError: injected failure on rank 0"),
    ("kill", 2, "was killed by signal SIGKILL"),
])
def test_the_rank_that_failed_is_named_not_its_peers(tmp_path, fault, rank, reason):
    run = Run(["--world-size", "3", "--fault", fault, "--fault-rank", str(rank), "--timeout", "60"],
              tmp_path).finish()
    print(f"\n{fault} on rank {rank}: {run.seconds:.1f} s: {_headline(run)}")
    assert run.proc.returncode == 1
    assert _headline(run) == f"rank {rank} of 3 {reason}"
    assert "__main__.RankError" not in run.err  # cli.main caught the launcher's own error class
    assert run.seconds < START_S, "a failure must be reported at once, not at the timeout"
    run.assert_clean()


def test_a_hung_rank_is_named_and_its_waiters_are_told_apart(tmp_path):
    run = Run(["--world-size", "3", "--fault", "hang", "--fault-rank", "2", "--timeout", "12"],
              tmp_path).finish()
    print(f"\nhang on rank 2: {run.seconds:.1f} s: {run.err[:300]}")
    assert run.proc.returncode == 1
    assert _headline(run).startswith("rank 2 of 3 did not finish within 12 s: it was in hello (hello.py:")
    assert "outside any collective" in _headline(run)
    assert "(ranks 0, 1 waited for it in barrier)" in run.err
    assert "--- rank 2 was here ---" in run.err and "in hello" in run.err  # its stack, from faulthandler
    assert 12 <= run.seconds < 12 + START_S
    run.assert_clean()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.parametrize("when", ["early", "late"])
def test_a_killed_parent_leaves_no_rank_and_no_folder(tmp_path, sig, when):
    """Early: the moment its ranks exist (still importing torch). Late: once every rank is running."""
    run = Run(["--world-size", "3", "--fault", "hang", "--fault-rank", "0", "--timeout", "120"], tmp_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        started = run.ranks_started()
        beating = glob.glob(os.path.join(run.tmpdir, "labs-spawn-*", "rank*.beat"))
        if (when == "early" and started) or (when == "late" and len(beating) == 3):
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"the ranks did not start ({when})")
    os.kill(run.proc.pid, sig)
    killed = time.monotonic()
    run.finish(timeout=15)  # the parent's stdout and stderr close: no rank inherited them
    run.assert_clean(within=10)
    print(f"\nparent {sig.name} {when}: everything gone {time.monotonic() - killed:.2f} s after the kill")


def test_a_rank_that_cannot_start_says_why(tmp_path, monkeypatch):
    import unstartable
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(launch.RankError) as info:
        launch.spawn(unstartable.work, 2, timeout=60)
    message = str(info.value)
    assert message.startswith(f"rank {info.value.rank} of 2 failed to start: ImportError: deliberately "
                              "unimportable")
    assert "must import without error in a new process" in message
    assert time.monotonic() - start < START_S
    assert os.listdir(tmp_path) == []


def test_a_script_without_a_main_guard_works(tmp_path):
    """Ranks never import the caller's script, so the guard that multiprocessing's spawn needs is not
    needed."""
    script = tmp_path / "no_guard.py"
    script.write_text("from labs.launcher import hello, launch\n"
                      "print(sum(r['sum_of_ranks'] for r in launch.spawn(hello.hello, 2)))\n")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=REPO),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"


def test_under_torchrun_a_raising_rank_is_named_with_its_traceback(tmp_path):
    run = Run(["--fault", "raise", "--fault-rank", "1", "--timeout", "60"], tmp_path, torchrun=True).finish()
    print(f"\ntorchrun raise on rank 1: {run.seconds:.1f} s")
    assert run.proc.returncode != 0
    assert "rank 1 of 3 raised RuntimeError: injected failure on rank 1" in run.err
    assert 'in hello\n    raise RuntimeError(f"injected failure on rank {rank}")' in run.err  # the traceback
    root = run.err.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1 (local_rank: 1)" in root, root
    assert run.seconds < 60
    run.assert_clean()


def test_under_torchrun_a_hung_rank_is_named(tmp_path):
    run = Run(["--fault", "hang", "--fault-rank", "2", "--timeout", "12"], tmp_path, torchrun=True).finish()
    print(f"\ntorchrun hang on rank 2: {run.seconds:.1f} s")
    assert run.proc.returncode != 0
    assert "rank 2 of 3 did not finish within 12 s: it was in hello (hello.py:" in run.err
    assert "(ranks 0, 1 waited for it in barrier)" in run.err
    assert "Current thread" in run.err or "Thread 0x" in run.err  # each rank's stack
    assert 12 <= run.seconds < 12 + START_S + 10  # torchrun's own start and stop come on top
    run.assert_clean()


@pytest.mark.parametrize("args, message", [
    (["labs.launcher.hello", "--world-size", "10000"], "10000 ranks need about"),
    (["labs.launcher.hello", "--timeout", "0"],
     "argument --timeout: expected a positive finite number, got 0"),
    (["labs.launcher.hello", "--timeout", "-1"],
     "argument --timeout: expected a positive finite number, got -1"),
    (["labs.launcher.hello", "--timeout", "nan"],
     "argument --timeout: expected a positive finite number, got nan"),
    (["labs.launcher.hello", "--timeout", "inf"],
     "argument --timeout: expected a positive finite number, got inf"),
    (["labs.launcher.hello", "--timeout", "1e12"], "argument --timeout: expected at most 86,400, got 1e12"),
    (["labs.launcher.hello", "--fault", "hang", "--fault-rank", "5"], "--fault-rank 5 is not a rank of 2"),
    (["labs.pipeline.executor", "--world-size", "4", "--microbatches", "100000000"],
     "above the 3,000,000 this lab builds"),
    (["labs.pipeline.executor", "--microbatches", "2000", "--timeout", "60"],
     "take at least 300 s, above --timeout 60"),
    (["labs.pipeline.executor", "--unit-ms", "-1"],
     "argument --unit-ms: expected a positive finite number, got -1"),
    (["labs.data_parallel.ring_allreduce", "--numel", "1000000000000"], "for --numel) but this machine has"),
    (["labs.tensor_parallel.blocks", "--hidden", "1200000"],
     "for --hidden, --batch or --seq) but this machine has"),
    (["labs.memory_budget.budget", "--gpu-gib", "-5"],
     "argument --gpu-gib: expected a positive finite number, got -5"),
    (["labs.memory_budget.budget", "--zero-stage", "7"], "argument --zero-stage: invalid choice: 7"),
])
def test_bad_input_is_one_sentence_before_anything_starts(monkeypatch, capsys, args, message):
    """Each lab's command line, run in this process with starting a rank made impossible."""
    import importlib
    from labs.launcher import cli

    def no_start(*_):
        raise AssertionError("a process was started before the input was refused")
    monkeypatch.setattr(launch, "_start_rank", no_start)
    monkeypatch.setattr(launch, "_start_janitor", no_start)
    module = importlib.import_module(args[0])
    with pytest.raises(SystemExit) as info:
        cli.main(lambda: module.main(args[1:]))
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1
