"""The zygote: ranks forked from one process that imported torch once (labs/launcher/zygote.py), with the
same semantics as fresh interpreters: environment, working directory, no survivor when it dies."""
import os
import time

import pytest

import workers
from labs.launcher import launch, zygote

pytestmark = pytest.mark.skipif(not zygote.enabled(), reason="the zygote is used on Linux only")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_are_forked_by_one_zygote_and_see_the_callers_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LABS_TEST_NOTE", "first")
    first = launch.spawn(workers.process_facts, 2, ("LABS_TEST_NOTE",), timeout=60)
    monkeypatch.setenv("LABS_TEST_NOTE", "second")   # read at run time: reaches the same zygote's ranks
    monkeypatch.chdir(tmp_path)
    second = launch.spawn(workers.process_facts, 3, ("LABS_TEST_NOTE",), timeout=60)
    parents = {r["ppid"] for r in first + second}
    assert len(parents) == 1 and os.getpid() not in parents, "every rank is a child of one zygote"
    assert [r["env"]["LABS_TEST_NOTE"] for r in first + second] == ["first"] * 2 + ["second"] * 3
    assert {r["cwd"] for r in second} == {str(tmp_path)}
    assert {r["argv0"] for r in first} == {"_rank.py"}  # what a fresh rank's sys.argv[0] is
    assert {r["threads"] for r in first} == {1}  # gloo ranks still pin one intra-op thread each
    assert len({r["pid"] for r in first + second}) == 5

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read when libraries load: needs a new zygote
    third = launch.spawn(workers.process_facts, 2, ("OMP_NUM_THREADS",), timeout=60)
    assert {r["ppid"] for r in third}.isdisjoint(parents)
    assert [r["env"]["OMP_NUM_THREADS"] for r in third] == ["1", "1"]


def test_a_zygote_that_dies_takes_its_ranks_and_the_run_fails_by_name(tmp_path):
    with pytest.raises(launch.RankError) as info:
        launch.spawn(workers.kill_parent_then_wait, 2, str(tmp_path), timeout=60)
    assert "was killed by signal SIGKILL" in str(info.value)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, pids)), "a rank outlived its zygote"
    assert not [z for z in zygote._zygotes if z.alive() and z.live], "no zygote still holds a rank"
    after = launch.spawn(workers.report_rank, 2, timeout=60)  # a new zygote serves the next call
    assert [r["sum"] for r in after] == [1.0, 1.0]


def test_without_the_zygote_each_rank_is_a_fresh_interpreter(monkeypatch):
    monkeypatch.setenv(zygote.ENV, "0")
    results = launch.spawn(workers.process_facts, 2, timeout=60)
    assert {r["ppid"] for r in results} == {os.getpid()}
