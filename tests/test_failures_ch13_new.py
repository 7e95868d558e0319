"""Chapter 13's torchft, out-of-memory, compression and DiLoCo labs, and chapter 12's key clash:
the command-line contract and the input refused before any process starts. The runs themselves
are checked by notebooks 12 and 13 under nbval (each run once); here only what they do not cover."""
import pytest
import torch

from labs import model as tiny
from labs.checkpointing import key_clash
from labs.failures import compression, diloco, oom, torchft_replica, torchft_run
from labs.launcher import under_load

MAINS = [torchft_run.main, torchft_replica.main, oom.main, compression.main, diloco.main, key_clash.main,
         under_load.main]


@pytest.mark.parametrize("main", MAINS, ids=lambda m: m.__module__)
def test_every_new_lab_keeps_the_command_line_contract(main, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--json" in out and "--timeout" in out


@pytest.mark.parametrize("call, message", [
    (lambda: torchft_run.torchft(steps=10, kill_step=8), "--kill-step 8"),
    (lambda: torchft_run.torchft(kill_replica=3), "--kill-replica 3"),
    (lambda: oom.oom(every=3, long_at=6), "--long-at 6"),
    (lambda: oom.oom(micro=3), "--micro 3"),
    (lambda: compression.compression(ratio=1.5), "--ratio 1.5"),
    (lambda: compression.compression(methods=("topk",)), "must include ddp"),
    (lambda: diloco.diloco(steps=20, hs=(8,)), "--steps 20"),
    (lambda: key_clash.key_clash(world_size=3), "--world-size 3"),
    (lambda: under_load.under_load(busy=-1), "--busy -1"),
], ids=["kill-step", "kill-replica", "long-at", "micro", "ratio", "no-ddp", "diloco-steps", "clash-ws",
        "busy"])
def test_bad_input_is_one_sentence_before_any_process_starts(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        call()


def test_the_memory_limit_fails_in_backward_and_not_below_it():
    """The limit the OOM lab sets: a step whose backward needs more than the limit raises
    torch.OutOfMemoryError there and says so; the same step under a limit above its peak runs."""
    torch.manual_seed(0)
    model = tiny.build(oom.CFG, seed=0)
    x, y = tiny.synthetic_batch(oom.CFG, 2, seed=0, seq_len=8)
    guard = oom.MemoryLimit(float("inf"), model)
    with guard:
        guard.phase = "forward"
        loss = model(x, y)
        guard.phase = "backward"
        loss.backward()
    assert guard.forward_peak < guard.peak_bytes
    model.zero_grad(set_to_none=True)
    tight = oom.MemoryLimit((guard.forward_peak + guard.peak_bytes) // 2, model)
    with pytest.raises(torch.OutOfMemoryError, match="in backward"), tight:
        tight.phase = "forward"
        loss = model(x, y)
        tight.phase = "backward"
        loss.backward()


def test_a_pid_that_has_exited_is_not_alive():
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert torchft_run.alive([p.pid]) == [] and torchft_run.alive([__import__("os").getpid()])


def _step_log(steps, participants=3):
    return [{"event": "step", "step": s, "committed": True, "participants": participants} for s in steps]


def test_the_replay_reads_its_schedule_from_a_survivor_that_never_healed():
    from labs.failures import torchft_check as check
    # the mistake: reading replica 0's log when replica 0 was itself left out of a quorum and healed,
    # jumping from step 12 to 14; its log has no step 13 (the KeyError the replay once raised)
    healed = _step_log([*range(13), *range(14, 20)])
    steady = _step_log(range(20))
    victim = _step_log(range(6))
    assert check.steady_survivor({0: healed, 1: steady, 2: victim}, victim=2, n=3) == 1
    with pytest.raises(RuntimeError, match="left out of a quorum"):
        check.steady_survivor({0: healed, 1: healed, 2: victim}, victim=2, n=3)
    # a step averaged over one group alone (the other survivor dropped too) is refused as well
    alone = _step_log(range(20))
    alone[9]["participants"] = 1
    with pytest.raises(RuntimeError):
        check.steady_survivor({0: alone, 1: alone, 2: victim}, victim=2, n=3)
