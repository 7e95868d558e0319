"""The launcher: results in rank order, failures named by rank, no hangs, no orphans."""
import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

import workers
from labs.launcher import launch, preflight

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes once it has exited.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(world_size):
    results = launch.spawn(workers.report_rank, world_size, timeout=60)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world_size"] == world_size for r in results)
    assert all(r["sum"] == world_size * (world_size - 1) / 2 for r in results)
    assert not any(_alive(r["pid"]) for r in results), "a rank outlived the call"


def test_a_raising_rank_is_named_with_its_traceback():
    with pytest.raises(launch.RankError) as info:
        launch.spawn(workers.raise_on, 3, 1, timeout=60)
    assert info.value.rank == 1
    message = str(info.value)
    assert message.startswith("rank 1 of 3 raised ValueError: deliberate failure on rank 1")
    assert "Traceback" in message and "raise_on" in message


def test_a_dying_rank_is_named():
    with pytest.raises(launch.RankError) as info:
        launch.spawn(workers.exit_on, 2, 0, timeout=60)
    assert info.value.rank == 0
    assert "exited with code 3" in str(info.value)


def test_a_hanging_rank_times_out_named_and_nothing_survives(tmp_path):
    with pytest.raises(launch.RankTimeout) as info:
        launch.spawn(workers.hang_on, 3, 2, str(tmp_path), timeout=8)
    assert info.value.rank == 2 and info.value.culprits == [2] and info.value.ranks == [0, 1, 2]
    message = str(info.value)
    assert message.startswith("rank 2 of 3 did not finish within 8 s: it was in hang_on (workers.py:")
    assert "hang_on" in message  # the stack of the stuck rank points at the line it is stuck on
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 3
    assert not any(_alive(pid) for pid in pids), "a stuck rank outlived the call"


def test_two_calls_at_once_do_not_collide():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(launch.spawn, workers.report_rank, 2, timeout=60) for _ in range(2)]
        results = [f.result() for f in futures]
    assert all(r[1]["sum"] == 1.0 for r in results)


def test_rank_output_is_replayed_in_rank_order(capsys):
    assert launch.spawn(workers.print_then_return, 3, timeout=60) == [0, 1, 2]
    assert capsys.readouterr().out.splitlines() == [f"[rank {r}] hello from rank {r}" for r in range(3)]


def test_a_long_rank_log_says_what_it_leaves_out(capsys):
    launch.spawn(workers.print_lines, 1, 10_005, timeout=60)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[rank 0] (5 earlier lines of 10,005 not shown)"
    assert out[1] == "[rank 0] line 5" and out[-1] == "[rank 0] line 10004" and len(out) == 10_001


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "60"])
def test_bad_timeouts_are_refused_in_one_sentence(bad):
    with pytest.raises(ValueError, match="timeout must be a number of seconds above 0"):
        launch.spawn(workers.report_rank, 2, timeout=bad)


def test_more_ranks_than_memory_holds_are_refused_before_start(monkeypatch):
    monkeypatch.setattr(preflight, "available_bytes", lambda: 4 * preflight.RANK_BYTES)
    with pytest.raises(ValueError, match="use at most 4 ranks, or set LABS_MAX_RANKS to try anyway"):
        launch.spawn(workers.report_rank, 5)
    monkeypatch.setenv("LABS_MAX_RANKS", "3")
    with pytest.raises(ValueError, match="world_size 5 is above LABS_MAX_RANKS=3"):
        launch.spawn(workers.report_rank, 5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "2", True, None])
def test_bad_world_sizes_are_refused_in_one_sentence(bad):
    with pytest.raises(ValueError, match="world_size must be"):
        launch.spawn(workers.report_rank, bad)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        launch.spawn(workers.report_rank, 2, backend="mpi")


def test_forced_nccl_with_too_few_gpus_is_refused(monkeypatch):
    import torch
    monkeypatch.setenv("LABS_BACKEND", "nccl")
    too_many = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    with pytest.raises(ValueError, match=f"NCCL needs one GPU per rank: {too_many} ranks asked"):
        launch.spawn(workers.report_rank, too_many)


def test_a_function_from_a_notebook_cell_is_refused():
    def from_a_cell(rank, world_size):
        return rank
    from_a_cell.__module__ = "__main__"
    with pytest.raises(ValueError, match="cannot import"):
        launch.spawn(from_a_cell, 2)


def test_command_line_prints_one_json_object():
    out = subprocess.run([sys.executable, "-m", "labs.launcher.hello", "--world-size", "3", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["world_size"] == 3 and result["sum_of_ranks"] == result["expected_sum"] == 3.0


def test_command_line_bad_input_is_one_sentence():
    proc = subprocess.run([sys.executable, "-m", "labs.launcher.hello", "--world-size", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "expected a positive integer, got 0" in proc.stderr and "Traceback" not in proc.stderr


def test_the_same_lab_runs_under_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--nproc_per_node=2", "-m", "labs.launcher.hello", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=180, check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, "only global rank 0 reports"
    assert json.loads(lines[0])["sum_of_ranks"] == 1.0


def test_the_budget_calculator_reports_once_under_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--nproc_per_node=2", "-m", "labs.memory_budget.budget", "--model", "7B",
                          "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=180, check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, "only global rank 0 reports"
    assert json.loads(lines[0])["params"] > 6e9
