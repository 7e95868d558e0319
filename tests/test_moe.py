"""Chapter 7, multi-process: the expert-parallel layer equals one process and its all-to-alls carry the
right rows; the node-deduplicating dispatch, the gradient groups of EP x DP, EP folded with TP and
the all-to-all's tail under skew, each counted. One 4-rank run serves them all (`moe_workers.suite`)."""
import json

import pytest
import torch

from labs.launcher import cli, launch
from labs.expert_parallel import a2a_tail, ep_dp, moe, moe_check, router

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics

# fp32: the expert-parallel layer adds a token's k expert outputs in one index_add where the
# reference adds them expert by expert, and the router's gradient is an all-reduce of per-rank
# sums: the same additions in another order, a few ulps of values of order 1. A token sent to
# the wrong expert, or a missing gate, errs by order 1 (the unsorted dispatch below: > 0.1).
TOL = 1e-5


@pytest.fixture(scope="module")
def four():
    import moe_workers
    return launch.spawn(moe_workers.suite, 4, timeout=300)


@pytest.fixture(scope="module")
def three():
    return launch.spawn(moe_check.check_layer, 3, 24, 16, 12, 2, None, timeout=300)


def _layer_checks(results, experts):
    for r in results:
        assert r["max_abs_error"] < TOL and r["max_abs_error_grad"] < TOL, r["grad_errors"]
        # no choice is near a tie, so the routing (and every count below) is the same on any CPU
        assert r["routing_margin"] > router.margin_bound(experts), r["routing_margin"]
        assert r["rows_arrived_right"]           # the right tokens' rows, in the order the splits say
        # bytes per destination, read from the payloads, against the reference's routing
        assert r["sent_to"] == r["derived_to"] and r["combine_to"] == r["derived_combine_to"]
        # N/ep int64 counts each
        assert r["splits_bytes"] == (len(results) - 1) * (experts // len(results)) * 8
        assert r["all_to_all_calls"] == 3         # splits, dispatch, combine


def test_expert_parallel_equals_one_process_with_and_without_drops(three, four):
    _layer_checks(three, 12)
    _layer_checks([r["layer_cf1"] for r in four], 12)
    _layer_checks([r["layer_node_limited"] for r in four], 16)
    _layer_checks([r["layer_grouped"] for r in four], 8)   # dropless, each rank's experts as a grouped GEMM
    assert three[0]["dropped_pairs"] == 0 and four[0]["layer_cf1"]["dropped_pairs"] > 0


def test_a_dispatch_whose_rows_do_not_follow_its_splits_is_caught(four):
    bad = [r["layer_unsorted"] for r in four]
    assert all(r["sent_to"] == r["derived_to"] for r in bad)        # the byte counts cannot see it
    assert not any(r["rows_arrived_right"] for r in bad)            # the rows that arrive can
    assert max(r["max_abs_error"] for r in bad) > 0.1               # and the output is wrong


def test_node_deduplicating_dispatch_counted_per_tier(four):
    rows = {k: {"flat": [0, 0], "node": [0, 0]} for k in ("unlimited", "one_node")}
    for rank, r in enumerate(four):
        for k, v in r["node"].items():
            assert v["error_flat"] < TOL and v["error_node"] < TOL   # both equal one process
            assert v["routing_margin"] > router.margin_bound(16)
            row, d = v["row_bytes"], v["derived_rows"]
            # counted from the payloads per destination == rows derived from the single-process routing
            assert v["flat"].get(("ib", "dispatch"), 0) == d["flat"]["ib"] * row
            assert v["flat"].get(("nvlink", "dispatch"), 0) == d["flat"]["nvlink"] * row
            assert v["node"].get(("ib", "node dispatch"), 0) == d["node"]["ib"] * row
            assert v["node"].get(("nvlink", "intra dispatch"), 0) == d["node"]["nvlink"] * row
            assert v["node"].get(("nvlink", "node dispatch"), 0) == 0
            assert v["node"].get(("ib", "intra dispatch"), 0) == 0
            for kind in ("flat", "node"):
                rows[k][kind][0] += d[kind]["ib"]
        # M = 1: every token reaches one node and crosses at most once (64 tokens per rank)
        assert (r["node"]["one_node"]["max_nodes_per_token"] == 1
                and r["node"]["one_node"]["derived_rows"]["node"]["ib"] <= 64)
    assert rows["unlimited"]["node"][0] < 0.6 * rows["unlimited"]["flat"][0]   # once per node, not per expert
    assert rows["one_node"]["node"][0] < 0.6 * rows["unlimited"]["node"][0]    # and the cap halves it again
    # flat: the cap saves nothing
    assert 0.8 < rows["one_node"]["flat"][0] / rows["unlimited"]["flat"][0] < 1.2


def test_expert_gradients_reduce_over_the_expert_data_parallel_group_only(four):
    for r in (x["ep_dp"] for x in four):
        assert r["router_error"] < TOL and r["expert_error"] < TOL
        assert r["expert_error_over_every_rank"] > 0.1 and r["expert_error_not_reduced"] > 0.1
        assert len(r["edp_group"]) == 2 and r["ep_group"] != r["edp_group"]
        # counted messages of the hand ring: 2(n-1)/n of the payload, n = 4 for the router, 2 for the experts
        assert r["router_bytes_sent"] == ep_dp.ring_bytes(r["router_payload"], 4)
        assert r["expert_bytes_sent"] == ep_dp.ring_bytes(r["expert_payload"], 2)


def test_expert_parallel_folded_with_tensor_parallel_attention(four):
    for r in (x["ep_tp"] for x in four):
        assert r["max_abs_error"] < TOL and r["max_abs_error_grad"] < TOL, r["grad_errors"]
        assert r["routing_margin"] > router.margin_bound(8)
        assert r["tp_ops"][:2] == ["g forward all-gather", "g-bar forward reduce-scatter"]
        # splits, dispatch, combine, and their backward twins: this rank's s/tp tokens, dispatched once
        assert r["a2a_calls"] == 5 and r["tokens_dispatched"] == 2 * 8 // 2


def test_the_slowest_rank_receives_what_the_skew_predicts(four):
    skews = (0.0, 1.0, 1.5)
    rows = a2a_tail.tail_table([r["tail"] for r in four], skews, batches=2)
    for row in rows:
        assert row["routing_margin"] > router.margin_bound(8)
        assert row["worst_in_bounds"] < 1.0      # every rank's received bytes within 4 s.d. of the derivation
    by = {(r["skew"], r["placement"]): r for r in rows}
    assert ([by[(s, "contiguous")]["derived_ratio"] for s in skews]
            == sorted(by[(s, "contiguous")]["derived_ratio"] for s in skews))
    assert by[(1.5, "contiguous")]["measured_ratio"] > 2 > by[(1.5, "strided")]["measured_ratio"]
    assert abs(by[(0.0, "contiguous")]["derived_ratio"] - 1) < 1e-9


def test_indivisible_experts_and_bad_grids_are_refused():
    with pytest.raises(ValueError, match="10 experts cannot be spread evenly over ep = 4 ranks"):
        moe.check_ep(10, 4)
    with pytest.raises(ValueError, match="not divisible by the node limit M = 3"):
        router.route(torch.zeros(2, 8), 4, experts_per_node=4, max_nodes=3)
    with pytest.raises(ValueError, match="inclusion formula here is for k = 1 or 2"):
        a2a_tail.inclusion(torch.ones(4) / 4, 3)


def test_command_line_contract(capsys):
    moe_check.main(["--world-size", "2", "--experts", "4", "--top-k", "1", "--capacity-factor", "1.0",
                    "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["max_abs_error"] < TOL and r["rows_arrived_right"] and r["bytes_sent"] == r["derived_bytes_sent"]
    assert r["dropped_fraction"] * 64 == round(r["dropped_fraction"] * 64)  # a whole number of the 64 pairs
    with pytest.raises(SystemExit) as exit_:  # refused in one sentence before any rank starts
        cli.main(lambda: moe_check.main(["--world-size", "3", "--experts", "8"]))
    assert exit_.value.code == 2
    assert "cannot be spread evenly over ep = 3" in capsys.readouterr().err
