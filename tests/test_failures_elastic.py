"""Chapter 13's elastic restart, run by torchrun itself: one rank SIGKILLs itself on attempt 0.

With --max-restarts=1 the agent must restart the whole group and the workers resume from the
latest checkpoint to the weights of an uninterrupted run; with --max-restarts=0 the job must fail.
One torchrun run per fixture (each costs seconds of start-up). The bit-for-bit check compares a run
with its own replay (the same operations in the same order), which agree on any CPU, so it is not
marked `numerics` and runs once."""
import time

import psutil
import pytest

from labs.launcher import cli
from labs.failures import elastic

STEPS, EVERY, KILL_STEP, KILL_RANK = 8, 3, 5, 1


@pytest.fixture(scope="module")
def restarted():
    return elastic.elastic(2, STEPS, EVERY, KILL_STEP, KILL_RANK, restarts=(1,))["restarts_1"]


@pytest.fixture(scope="module")
def not_restarted():
    return elastic.elastic(2, STEPS, EVERY, KILL_STEP, KILL_RANK, restarts=(0,))["restarts_0"]


def assert_gone(pids, within=10):
    """Every worker PID the run recorded has exited (a zombie counts as exited)."""
    assert pids, "no worker recorded its PID: nothing was checked"
    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], f"orphans: {pids}"


def test_torchrun_restarts_the_group_after_a_rank_is_killed(restarted):
    r = restarted
    print(f"\n{r['command']}: {r['seconds']:.1f} s; survivors {r['survivors_stopped']}")
    assert r["returncode"] == 0 and r["attempts_seen"] == [0, 1]   # attempt 1 really ran, and finished
    assert r["restart_decisions"] == 1                              # the agent's own log says it restarted
    assert r["killed_rank_ended"] == "SIGKILL" and r["killed_at_step"] == KILL_STEP
    assert r["killed_exit_in_log"] == -9                            # the agent saw that pid die of SIGKILL
    # ... and stopped the survivor
    assert r["survivors_sigtermed"] == [0] and r["survivors_stopped"] == {0: "SIGTERM"}
    # both attempts bootstrap from one TCPStore kept by the agent: why the workers prefix it per attempt
    assert len(r["store_ports"]) == 2 and len(set(r["store_ports"])) == 1
    assert_gone(r["pids"])


def test_the_restart_resumes_from_the_latest_checkpoint_and_redoes_only_the_steps_since(restarted):
    r = restarted
    assert r["resumed_from"] == 3                                   # not step 0: the checkpoint was read
    # counted from the steps each attempt logged, against kill step - checkpoint step
    assert r["redone_steps"] == [3, 4] and r["steps_redone"] == r["killed_at_step"] - r["resumed_from"]


def test_the_resumed_run_ends_on_an_uninterrupted_runs_weights_bit_for_bit(restarted):
    # same operations in the same order, one intra-op thread in every worker: exact equality
    assert restarted["threads"] == [1]
    assert restarted["redone_losses_equal"]                         # attempt 1 recomputed attempt 0's losses
    assert restarted["final_losses_equal"] and restarted["final_weights_equal"]


def test_without_restarts_the_same_kill_fails_the_job(not_restarted):
    r = not_restarted
    assert r["returncode"] != 0 and r["attempts_seen"] == [0] and r["restart_decisions"] == 0
    assert r["killed_exit_in_log"] == -9
    assert "resumed_from" not in r
    assert_gone(r["pids"])


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "1"], "--world-size 1 has no survivor"),
    (["--kill-step", "6"], "must fall after a checkpoint"),        # 6 is a checkpoint step: a race
    (["--kill-rank", "2"], "--kill-rank 2 is not a rank of 2"),
])
def test_bad_input_is_one_sentence_before_torchrun_starts(capsys, argv, message):
    with pytest.raises(SystemExit):
        cli.main(lambda: elastic.main(argv))
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
