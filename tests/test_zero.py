"""Chapter 3: the hand ZeRO stages hold the formulas' bytes, peak lower stage by stage, send what
the stages predict under gradient accumulation, and train like one process."""
import json
import os
import subprocess
import sys

import pytest
import torch

from labs.launcher import launch
from labs import model as tiny
from labs.zero import stages, adam_drift
from labs.zero.sharded_optimizer import ShardedOptimizer

import zero_workers

# The tests marked `numerics` compare floating-point results: `make test` runs them under
# another CPU's rounding. The others compare bytes, counts, schedules or refusals.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each rank's bf16 gradient is rounded before the average, one process rounds the whole batch's:
# they agree to a few bf16 ulps (2^-8 relative) of the largest entry. A missing 1/N is off by 50%+.
GRAD_TOL = 0.02
TENSOR_GRAD_TOL = stages.TENSOR_GRAD_TOL   # each tensor against its own largest gradient
KEYS = ("0", "1", "1-allreduce", "2", "3", "3-whole")
BLOCK_NUMEL = tiny.num_params(tiny.GPT(tiny.GPTConfig()).blocks[0])   # one transformer block


@pytest.fixture(scope="module")
def two_ranks():
    return launch.spawn(stages.all_stages, 2, 2, timeout=300)


@pytest.fixture(scope="module")
def three_ranks():
    # batch 1: the tiny GPT's 30k parameters (16 bytes each) dominate its activations
    return launch.spawn(stages.all_stages, 3, 2, batch_size=1, timeout=300)


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3])
def test_bytes_held_and_sent_equal_the_formulas(world_size, two_ranks, three_ranks):
    results = two_ranks if world_size == 2 else three_ranks
    for key in KEYS:
        stage, padded = int(key[0]), results[0][key]["padded"]
        assert padded % world_size == 0
        for r in (r[key] for r in results):
            assert r["comm_kind"] == "counted messages"   # hand rings: every message counted as sent
            assert r["held"]["total"] == stages.formula_bytes(stage, padded, world_size), key
            # every storage reachable from the model, optimizer and HandFSDP is counted, or is a
            # step counter or a module buffer: nothing held outside the listed categories
            held = r["held"]
            assert held["reachable"] == held["total"] + held["step_counters"] + held["buffers"], key
            want = stages.formula_comm(stage, padded, world_size, key == "1-allreduce")
            assert r["comm_bytes_per_step"] == want, key
            assert r["grad_rel_error_vs_single_process"] < GRAD_TOL, key
            assert r["grad_rel_error_per_tensor"] < TENSOR_GRAD_TOL, key
            assert r["max_param_diff_vs_single_process"] <= r["param_bound"], key
            assert r["update_error_vs_single_process"] < adam_drift.UPDATE_TOL, key


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_stage_takes_exactly_the_ddp_step(world_size, two_ranks, three_ranks):
    # Stages 0-3 share one layout (a bucket or unit per block, one for the rest) and the hand
    # ring's reduce-scatter is the first half of its all-reduce, so every sum is the same: bit for
    # bit, at any N, on every rank (a final all-gather wrong on ranks 1 and up fails it). Gathering
    # the whole model changes the layout, hence the order of a 3-term bf16 sum; 2 terms commute.
    keys = KEYS if world_size == 2 else KEYS[:-1]
    for r in (two_ranks if world_size == 2 else three_ranks):
        for key in keys:
            assert r[key]["losses"] == r["0"]["losses"], key
            torch.testing.assert_close(r[key]["params"], r["0"]["params"], rtol=0, atol=0)


@pytest.mark.numerics
def test_peak_falls_stage_by_stage(two_ranks, three_ranks):
    for results in (two_ranks, three_ranks):
        for r in results:
            peak = {k: r[k]["peak"]["peak_bytes"] for k in KEYS}
            # gathering one block at a time, not the whole model, is what lowers ZeRO-3's peak: by at
            # least one more block's bf16 weights (the notebook's margin), so a "per-unit" ZeRO-3 that
            # gathered nearly everything at once fails
            assert peak["3-whole"] - peak["3"] >= 2 * BLOCK_NUMEL, peak
            # that margin passes a ZeRO-3 that keeps every block gathered from forward to backward
            # (its peak sits between the two); the count of units gathered at once does not: the root
            # and the one block at work, against the whole model's one unit
            assert (r["3"]["max_units_gathered"], r["3-whole"]["max_units_gathered"]) == (2, 1)
            for k in KEYS:   # the peak includes everything held between steps
                assert peak[k] >= r[k]["held"]["total"] + r[k]["held"]["step_counters"]
    for r in three_ranks:   # where parameters dominate, each stage's peak is below the previous one's
        peak = [r[k]["peak"]["peak_bytes"] for k in ("0", "1", "2", "3")]
        assert peak == sorted(peak, reverse=True) and len(set(peak)) == 4, peak


@pytest.mark.numerics
def test_from_ddp_to_zero2_the_peak_falls_less_than_the_held_bytes(three_ranks):
    # DDP and ZeRO-2 are one ShardedOptimizer at stages 0 and 2 (one recipe: bf16 weights and
    # gradients, fp32 master), so only which bytes are sharded differs. The activations and most
    # temporaries are not sharded: at batch 1 on 3 ranks the peak falls, but by less than the held
    # bytes (the chapter's same-recipe claim; the notebook checks it on 3 and 4 ranks)
    top = {k: max((r[k] for r in three_ranks), key=lambda x: x["peak"]["peak_bytes"]) for k in ("0", "2")}
    held = top["0"]["held"]["total"] / top["2"]["held"]["total"]
    peak = top["0"]["peak"]["peak_bytes"] / top["2"]["peak"]["peak_bytes"]
    assert 1 < peak < held, (peak, held)


def _check_gradient_freed_in_backward(r, stage):
    """ZeRO-2 reduce-scatters from the backward hook: the full bf16 gradient (2 bytes per padded
    parameter) is never live at once, and right after each bucket's reduction returns exactly the
    buckets still filling are live (each reduced bucket freed); DDP and ZeRO-1 hold all of it."""
    full, live = 2 * r["padded"], r["peak"]["full_grad_live_bytes"]
    assert live < full if stage == 2 else live == full, (stage, live, full)
    if stage == 2:
        reductions = r["peak"]["grad_reductions"]
        assert stages.frees_each_bucket(reductions), reductions
        assert reductions[-1]["live_after"] == 0   # nothing left when backward ends
    assert r["peak"]["backward_peak_bytes"] <= r["peak"]["peak_bytes"]


def test_zero2_never_holds_the_whole_gradient(two_ranks, three_ranks):
    for results in (two_ranks, three_ranks):
        for r in results:
            for stage in (0, 1, 2):
                _check_gradient_freed_in_backward(r[str(stage)], stage)


@pytest.fixture(scope="module")
def bugs():
    return launch.spawn(zero_workers.plausible_bugs, 2, timeout=300)


def test_a_zero2_that_reduces_only_at_the_end_of_backward_is_caught(bugs):
    # The bug keeps the whole gradient until backward ends: its peak is the correct ZeRO-2's at
    # N = 2 (the peak falls in Adam's step) and it still trains exactly; the live count refuses it.
    for r in bugs:
        with pytest.raises(AssertionError):
            _check_gradient_freed_in_backward(r["at_end"], 2)


def test_a_zero2_that_never_frees_one_bucket_is_caught(bugs, two_ranks):
    # The bug leaves block 0's full gradient live after its reduction, until backward ends. The rest
    # bucket (embedding and head) is live through all of backward anyway, so the most gradient bytes
    # live at a reduction, and the peak, are the correct ZeRO-2's: "less than the whole" passes it.
    # The bucket-by-bucket check refuses it.
    for r, good in zip(bugs, two_ranks):
        bug = r["keeps_block0"]
        assert bug["peak"]["full_grad_live_bytes"] == good["2"]["peak"]["full_grad_live_bytes"]
        assert bug["peak"]["full_grad_live_bytes"] < 2 * bug["padded"]
        assert not stages.frees_each_bucket(bug["peak"]["grad_reductions"])
        with pytest.raises(AssertionError):
            _check_gradient_freed_in_backward(bug, 2)


def test_a_zero2_that_stashes_each_full_bucket_is_caught(bugs):
    # The bug sets b.grad to None after each reduction but keeps the full bucket in a list until
    # backward ends: by the bucket attributes every bucket was freed, and it trains exactly. The
    # live bytes are measured on the storages themselves, so the check refuses it.
    for r in bugs:
        bug = r["stashes"]
        assert bug["max_param_diff_vs_single_process"] <= bug["param_bound"]
        assert not stages.frees_each_bucket(bug["peak"]["grad_reductions"])
        with pytest.raises(AssertionError):
            _check_gradient_freed_in_backward(bug, 2)


@pytest.mark.numerics
def test_a_wrongly_scaled_step_is_caught(bugs):
    # The sharded optimizer's lr scaled, one process's not: DDP and ZeRO-1 share the bug and agree
    # bit for bit, and the drift bound passes them. The update check refuses 2x (error ~1) and 1.1x
    # (~0.09, which a tolerance of 0.5 would pass); a correct run scores ~0.003.
    for r in bugs:
        for scale, runs in r["scaled_lr"].items():
            assert torch.equal(runs["0"]["params"], runs["1"]["params"])
            for s in ("0", "1"):
                assert runs[s]["max_param_diff_vs_single_process"] <= runs[s]["param_bound"]
                assert runs[s]["update_error_vs_single_process"] >= adam_drift.UPDATE_TOL, (scale, s)


def test_a_step_that_never_updates_the_weights_is_caught():
    # The bug steps the fp32 master but never copies it into the bf16 weights. DDP and ZeRO-1 share it,
    # so they agree with each other exactly, and the drift bound (twice the largest Adam move, plus a
    # bf16 spacing) passes a run that never moved; the update check refuses it: its update is 0.
    buggy = launch.spawn(zero_workers.never_copies_master, 3, timeout=180)
    for r in buggy:
        assert torch.equal(r["0"]["params"], r["1"]["params"])
        for s in ("0", "1"):
            assert r[s]["max_param_diff_vs_single_process"] <= r[s]["param_bound"]
            assert r[s]["update_error_vs_single_process"] == 1 > adam_drift.UPDATE_TOL


@pytest.mark.numerics
def test_fsdp2_matches_hand_zero3_and_shards_every_weight(two_ranks):
    world_size = 2
    fsdp = launch.spawn(stages.fsdp2_and_kept, world_size, 2, 2, timeout=180)
    # Same recipe, same sums: bf16 weights cast from the same fp32 masters, a 2-term bf16
    # reduce-scatter (order-free), fp32 Adam elementwise: the losses agree exactly.
    assert fsdp[0]["losses"] == two_ranks[0]["3"]["losses"]
    assert sum(r["local_numel"] for r in fsdp) == fsdp[0]["numel"]
    for shard in fsdp[0]["shards"].values():
        assert shard["placements"] == "(Shard(dim=0),)"
        assert shard["local_shape"][0] == -(-shard["full_shape"][0] // world_size)
    for r, hand in zip(fsdp, two_ranks):   # FSDP2 shards and frees like ZeRO-3, unlike DDP
        assert r["peak"]["peak_bytes"] < hand["0"]["peak"]["peak_bytes"]
        assert r["held"]["total"] < hand["1"]["held"]["total"]
        # on the hand rings (FSDP2's custom-collective hooks): counted, and the root is gathered
        # once, not twice (FSDP2 keeps the root unsharded from forward to backward)
        ops = r["comm_ops_per_step"]
        assert ops["all_gather"]["calls"] == 5 and ops["reduce_scatter"]["calls"] == 3
        assert r["comm_bytes_per_step"] < hand["3"]["comm_bytes_per_step"]
        # FSDP2 frees each block after its forward; told to keep them (reshard_after_forward=False) it
        # holds exactly both blocks' bf16 weights more when forward returns (so an FSDP2 that never
        # freed them scores 0 and is refused), which a peak compared with the hand whole-model gather
        # lets through
        blocks = 2 * sum(p.numel() for p in tiny.GPT(tiny.GPTConfig()).blocks.parameters())
        kept = r["kept_gathered"]
        assert stages.freed_after_forward(r["peak"], kept, blocks)
        assert kept["after_forward_bytes"] - r["peak"]["after_forward_bytes"] == blocks
        assert hand["3-whole"]["peak"]["peak_bytes"] - kept["peak_bytes"] >= blocks // 2


@pytest.mark.numerics
def test_library_collectives_train_the_same_and_give_formula_bytes():
    # The same stage on torch.distributed's own collectives: the same training (a 2-term sum is
    # order-free), and bytes that labs.measure.comm can only state as the ring formula
    lib = launch.spawn(stages.run, 2, 2, 2, collectives="library", timeout=180)
    hand = launch.spawn(stages.run, 2, 2, 2, timeout=180)
    for a, b in zip(lib, hand):
        assert a["comm_kind"] == "formula bytes" and b["comm_kind"] == "counted messages"
        assert a["comm_bytes_per_step"] == b["comm_bytes_per_step"] == stages.formula_comm(2, a["padded"], 2)
        assert a["losses"] == b["losses"]
        assert torch.equal(a["params"], b["params"])


def test_gradient_accumulation_traffic():
    counts = launch.spawn(stages.accumulation, 2, timeout=300)
    for r in counts:
        sent = {s: {int(a): v["bytes_sent"] for a, v in r[s].items()} for s in r}
        ddp = sent["0"][1]
        for stage in ("0", "1"):   # reduce once per optimizer step: A does not matter
            assert sent[stage] == {1: ddp, 2: ddp, 4: ddp}
        # ZeRO-2: one reduce-scatter per micro-batch, one all-gather per step, each half of DDP's
        assert sent["2"] == {a: (a + 1) * ddp // 2 for a in (1, 2, 4)}
        # ZeRO-3: two all-gathers and a reduce-scatter per micro-batch
        assert sent["3"] == {a: a * 3 * ddp // 2 for a in (1, 2, 4)}


@pytest.mark.numerics
def test_adam_step_bound_is_reached_and_never_exceeded():
    b1, b2 = 0.9, 0.999
    for t in (1, 2, 3, 30, 250):
        # the worst history: gradients growing as (b2/b1)^i make Cauchy-Schwarz an equality
        w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([w], lr=1.0, eps=0.0)
        for i in range(1, t + 1):
            w.grad = torch.tensor([(b2 / b1) ** i], dtype=torch.float64)
            before = w.item()
            opt.step()
        assert abs(before - w.item()) == pytest.approx(adam_drift.adam_step_bound(t), rel=1e-9)
    assert adam_drift.adam_step_bound(2) > 1.0          # "at most lr" is wrong from step 2
    assert adam_drift.adam_step_bound(250) > 0.1 / 0.001 ** 0.5   # and so is Kingma & Ba's 3.16 lr
    g = torch.Generator().manual_seed(0)          # random histories stay under it
    w = torch.zeros(1000, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([w], lr=1.0, eps=0.0)
    for t in range(1, 40):
        w.grad = torch.randn(1000, generator=g, dtype=torch.float64) * torch.rand(1000, generator=g) ** 4
        before = w.detach().clone()
        opt.step()
        assert (w.detach() - before).abs().max().item() <= adam_drift.adam_step_bound(t) * (1 + 1e-12)


def test_bad_inputs_are_refused():
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="stage must be 0"):
        ShardedOptimizer(net.parameters(), torch.optim.Adam, stage=3)
    with pytest.raises(ValueError, match="every trainable parameter exactly once"):
        ShardedOptimizer(net.parameters(), torch.optim.Adam, buckets=[[net.weight]])
    with pytest.raises(ValueError, match="one dtype"):
        net.bias.data = net.bias.data.double()
        ShardedOptimizer(net.parameters(), torch.optim.Adam, buckets=[[net.weight, net.bias]])
    with pytest.raises(ValueError, match="nothing to optimize"):
        ShardedOptimizer(net.requires_grad_(False).parameters(), torch.optim.Adam)


def test_command_line_contract():
    out = subprocess.run([sys.executable, "-m", "labs.zero.stages", "--world-size", "2", "--stage", "2",
                          "--steps", "2", "--json"], cwd=REPO, capture_output=True, text=True, timeout=180,
                         check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["state_bytes"] == [r["state_bytes_formula"]] * 2
    assert r["comm_bytes_per_step"] == [r["comm_bytes_formula"]] * 2
    assert all(p > s for p, s in zip(r["peak_bytes"], r["state_bytes"]))
    assert {"numel", "max_param_diff_vs_single_process"} <= set(r)


def test_the_checker_names_the_nominal_parameter_count_inside_the_tolerance(capsys):
    # 13e9 for Llama-2 13B's 13.016e9 lands 0.12 % low, inside the 1 % tolerance: named, not accepted
    assert not stages.check("2", 3 * 7 / 8 * 2 * 13e9 / 1e9)
    assert "parameters of the model's name" in capsys.readouterr().out
    assert stages.check("2", stages.EXERCISES["2"]())
    assert stages.check("2", round(stages.EXERCISES["2"](), 1))   # a rounded right answer still passes


def test_prefetch_layout_keeps_durations_and_holds_two_blocks():
    from labs.zero import timeline
    # a recorded one-stream step of two blocks (0, 1) and the root (2): gather, compute, reduce-scatter
    ev = [(2, "ag", 0, 1), (0, "ag", 1, 3), (0, "fwd", 3, 4), (1, "ag", 4, 6), (1, "fwd", 6, 7),
          (2, "ag", 7, 8), (1, "ag", 8, 10), (1, "bwd", 10, 12), (1, "rs", 12, 14),
          (0, "ag", 14, 16), (0, "bwd", 16, 18), (0, "rs", 18, 20), (2, "rs", 20, 21)]
    out, most = timeline.prefetch(ev, 3)
    assert sorted(e - s for *_, s, e in out) == sorted(e - s for *_, s, e in ev)
    assert timeline.most_gathered(ev, 3) == 1 and most == 2
    assert timeline.step_time(out) < timeline.step_time(ev)
    for kind in ("ag", "rs"):   # one stream each: collectives never overlap each other, nor computes
        for lane in (("ag", "rs"), ("fwd", "bwd")):
            spans = sorted((s, e) for _, k, s, e in out if k in lane)
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))


def test_reachable_bytes_sees_a_copy_held_bytes_does_not_list():
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(2, 8)).sum().backward()
    opt.step()
    held = stages.held_bytes(net, opt)
    assert stages.reachable_bytes(net, opt) == held["total"] + held["step_counters"]
    net.cache = net.weight.detach().clone()     # a leak: a full copy kept in another attribute
    assert stages.held_bytes(net, opt)["total"] == held["total"]
    assert stages.reachable_bytes(net, opt) == held["total"] + held["step_counters"] + 8 * 8 * 4


def test_toy_gradient_check_refuses_a_skipped_all_reduce_and_a_wrong_average():
    # the sharp check the unseen model is held to at N = 3 (the drift bound passes both mistakes)
    from labs.zero import unseen_model as toy
    want = toy.toy_reference(3, 1)["first_grad"]
    alone = toy.toy_reference(1, 1)["first_grad"]     # rank 0's batch only: no all-reduce
    assert toy.grad_error([(k, 0, g.reshape(-1)) for k, g in alone.items()], want) > 0.1
    assert toy.grad_error([(k, 0, 3 * g.reshape(-1)) for k, g in want.items()], want) > 0.1
    assert toy.grad_error([(k, 0, g.reshape(-1)) for k, g in want.items()], want) == 0


def test_the_update_check_refuses_a_run_that_leaves_three_percent_of_the_weights_unmoved():
    """The arithmetic of the tolerance: a run whose update matches everywhere but leaves 3 % of the
    weights where they started (biases and norms never stepped) scores 0.03, a factor 2 above
    UPDATE_TOL; so does a step scaled by 1.03; one whose every element is off by rounding-sized
    noise (0.5 %) scores below it."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(10_000, generator=g)
    step = 1e-3 * torch.sign(torch.randn(10_000, generator=g))
    want = start + step
    stuck = want.clone()
    stuck[:300] = start[:300]
    assert adam_drift.update_error(start, stuck, want) > 1.9 * adam_drift.UPDATE_TOL
    assert adam_drift.update_error(start, start + 1.03 * step, want) > 1.9 * adam_drift.UPDATE_TOL
    noisy = want + 0.005 * step * torch.sign(torch.randn(10_000, generator=g))
    assert adam_drift.update_error(start, noisy, want) < adam_drift.UPDATE_TOL


def test_a_small_tensor_missing_its_average_fails_the_per_tensor_check_only():
    """A missing 1/N on a tensor whose gradients are small beside the model's largest (a norm's weight)
    stays within GRAD_TOL of the largest gradient, and Adam ignores its scale, so only the per-tensor
    comparison sees it."""
    g = torch.Generator().manual_seed(0)
    ref = {"big": torch.randn(1000, generator=g), "norm": 0.01 * torch.randn(64, generator=g)}
    right = [(n, 0, t.clone()) for n, t in ref.items()]
    summed = [("big", 0, ref["big"].clone()), ("norm", 0, 2 * ref["norm"])]   # N = 2, not averaged
    assert stages._grad_error(right, ref) == 0 == stages.grad_error_per_tensor(right, ref)
    assert stages._grad_error(summed, ref) < GRAD_TOL
    assert stages.grad_error_per_tensor(summed, ref) == pytest.approx(1.0)
