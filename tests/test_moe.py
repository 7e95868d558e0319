"""Chapter 7: the expert-parallel MoE layer equals the single-process one; its all-to-alls carry
exactly the routed rows; drops, balance and node-limited routing behave as derived."""
import json
import os
import subprocess
import sys

import pytest
import torch

from labs.launcher import cli, launch
from labs.expert_parallel import moe, moe_routing as mr, router

# compares floating-point results: `make test` runs it again under another CPU's rounding
pytestmark = pytest.mark.numerics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32: the expert-parallel layer adds a token's k expert outputs in one index_add where the
# reference adds them expert by expert, and the router's gradient is an all-reduce of per-rank
# sums: the same additions in another order, a few ulps of values of order 1. A token sent to
# the wrong expert, or a missing gate, errs by order 1.
TOL = 1e-5


def _check_bytes(r, world_size, experts):
    # payloads read per destination from the tensors handed to the all-to-all, against the rows
    # derived from the routing of every rank's tokens by the single-process reference
    assert r["dispatch_bytes"] == r["derived_dispatch_bytes"]
    assert r["combine_bytes"] == r["derived_combine_bytes"]
    # backward: the gradient of dispatch travels like combine, and the other way round
    assert r["backward_bytes"] == {"dispatch backward": r["combine_bytes"], "combine backward": r["dispatch_bytes"]}
    # the split sizes: N/ep int64 counts to each other rank, counted apart from the rows
    assert r["splits_bytes"] == (world_size - 1) * (experts // world_size) * 8
    assert r["all_to_all_calls"] == 3  # splits, dispatch, combine
    assert r["formula_bytes_sent"] == r["dispatch_bytes"] + r["combine_bytes"] + r["splits_bytes"]


@pytest.mark.parametrize("world_size, capacity_factor", [(2, None), (3, 1.0), (4, 1.0)])
def test_expert_parallel_equals_the_single_process_layer(world_size, capacity_factor):
    experts, top_k = 12, 2
    results = launch.spawn(moe.check_layer, world_size, 24, 16, experts, top_k, capacity_factor, timeout=120)
    for r in results:
        assert r["max_abs_error"] < TOL and r["max_abs_error_grad"] < TOL, r["grad_errors"]
        _check_bytes(r, world_size, experts)
        # no choice is near a tie, so the routing (and the counts below) is the same on any CPU
        assert r["routing_margin"] > router.margin_bound(experts), r["routing_margin"]
    # capacity is per rank's batch, so the reference drops the same pairs: equal even with drops
    assert (results[0]["dropped_fraction"] == 0) == (capacity_factor is None)
    # every row dispatched comes back: the ranks' dispatch and combine bytes have equal totals
    assert sum(r["dispatch_bytes"] for r in results) == sum(r["combine_bytes"] for r in results)


def test_node_limited_routing_on_two_nodes():
    # 4 ranks, 2 per node, 16 experts (8 per node), top-4; M = 1 node per token
    limited = launch.spawn(moe.check_layer, 4, 32, 16, 16, 4, None, 0, (8, 1), timeout=120)
    for r in limited:
        assert r["max_abs_error"] < TOL and r["max_abs_error_grad"] < TOL
        assert r["routing_margin"] > router.margin_bound(16)
        _check_bytes(r, 4, 16)
    rows = launch.spawn(mr.node_limited, 4, timeout=120)
    for r in rows:
        assert r["unlimited"]["max_nodes_per_token"] == 2 and r["one_node"]["max_nodes_per_token"] == 1
        assert min(r[k]["routing_margin"] for k in ("unlimited", "one_node")) > router.margin_bound(16)
        # once per node, a token crosses at most M = 1 time: at most 64 tokens x 64 bytes
        assert r["one_node"]["once_per_node_bytes"] <= 64 * r["one_node"]["row_bytes"]
    once = {k: sum(r[k]["once_per_node_bytes"] for r in rows) for k in ("unlimited", "one_node")}
    flat = {k: sum(r[k]["cross_node_bytes"] for r in rows) for k in ("unlimited", "one_node")}
    # measured: the limit halves the bytes a once-per-node dispatch sends across (15616 -> 8320),
    # while a flat all-to-all, one row per (token, expert), moves about as much as before
    assert once["one_node"] < 0.6 * once["unlimited"]
    assert 0.8 < flat["one_node"] / flat["unlimited"] < 1.2


def test_indivisible_experts_are_refused():
    with pytest.raises(ValueError, match="10 experts cannot be spread evenly over ep = 4 ranks"):
        moe.check_ep(10, 4)
    with pytest.raises(ValueError, match="not divisible by the node limit M = 3"):
        router.route(torch.zeros(2, 8), 4, experts_per_node=4, max_nodes=3)


def test_capacity_priority_first_choices_first():
    # 3 tokens, all prefer expert 0 then expert 1; capacity 2: token 2 loses expert 0, and the
    # first choices of tokens 0 and 1 do not lose to anyone's second choice
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]] * 3)
    r = router.route(logits, 2, cap=2)
    assert r.idx.tolist() == [[0, 1]] * 3
    assert r.keep.tolist() == [[True, True], [True, True], [False, False]]
    assert router.capacity(tokens=3, experts=4, top_k=2, capacity_factor=1.25) == 2  # ceil(1.875)


def test_switch_aux_loss_is_alpha_when_uniform_and_alpha_n_when_collapsed():
    n, k, alpha = 8, 2, 1e-2
    idx = torch.arange(32).view(16, 2) % n  # every expert chosen 4 times
    uniform = router.Routing(torch.full((16, n), 1 / n), idx, None, None)
    assert mr.switch_aux_loss(uniform, n, k, alpha).item() == pytest.approx(alpha, rel=1e-6)
    collapsed = router.Routing(torch.tensor([[1.0, 0, 0, 0]] * 4), torch.zeros(4, 1, dtype=torch.long), None, None)
    assert mr.switch_aux_loss(collapsed, 4, 1, alpha).item() == pytest.approx(alpha * 4, rel=1e-6)


def test_dropped_fraction_follows_the_load_distribution():
    rows = mr.drop_curve([0.5, 1.0, 1.5, 2.0], trials=30)
    for row in rows:
        # batch by batch, the layer drops exactly sum_i max(0, L_i - C) / T of its measured loads
        assert row["per_batch"] == pytest.approx(row["from_loads"], abs=1e-9)
        # and on average what the Binomial(T, p_i) loads predict: within 4 standard errors
        assert abs(row["measured"] - row["predicted"]) < 4 * row["stderr"]
        assert row["routing_margin"] > router.margin_bound(8)   # the same choices on every CPU
    assert [r["measured"] for r in rows] == sorted((r["measured"] for r in rows), reverse=True)


def test_balancing_orders_the_final_imbalance():
    runs = mr.balance_runs(steps=200)  # the notebook runs 300; the order is set by step 150
    floor = runs["uniform_floor"]  # max/mean of a router with no preference, about 1.2 at T = 128
    # no balancing collapses toward N/k = 4; the bias and the aux loss at alpha = 0.1 reach the
    # floor: within 0.15, several times the spread of a 20-step mean of a uniform router's
    # max/mean (one step's standard deviation / sqrt(20)), while the unbalanced runs stay more
    # than 1.2 above it; alpha = 1e-2 is too weak in this many steps
    assert 0.15 > 4 * runs["uniform_spread"] / 20 ** 0.5
    assert runs["none"]["final"] > 2.5 and runs["aux 0.01"]["final"] > 2.5
    assert runs["bias 0.001"]["final"] < floor + 0.15 and runs["aux 0.1"]["final"] < floor + 0.15


def test_command_line_contract(capsys):
    out = subprocess.run([sys.executable, "-m", "labs.expert_parallel.moe", "--world-size", "2", "--experts", "4", "--top-k", "1",
                          "--capacity-factor", "1.0", "--json"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["max_abs_error"] < TOL and r["bytes_sent"] == r["derived_bytes_sent"]
    # the CLI reports the lab's own routing of the same tokens: 64 (token, expert) pairs, 4 experts
    ref = launch.spawn(moe.check_layer, 2, 32, 16, 4, 1, 1.0, timeout=120)[0]
    assert r["dropped_fraction"] == ref["dropped_fraction"] and r["max_over_mean_load"] == ref["max_over_mean_load"]
    assert r["dropped_fraction"] * 64 == round(r["dropped_fraction"] * 64)  # a whole number of dropped pairs
    assert r["max_over_mean_load"] == max(ref["loads"]) / (64 / 4)
    with pytest.raises(SystemExit) as exit_:  # refused in one sentence before any rank starts
        cli.main(lambda: moe.main(["--world-size", "3", "--experts", "8"]))
    assert exit_.value.code == 2
    assert "cannot be spread evenly over ep = 3" in capsys.readouterr().err
