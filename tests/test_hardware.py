"""Chapter 11: the placement calculator decides group by group and agrees with the bytes counted by
each message's destination; Llama 3's stage split; bad input. Notebook 11 asserts the real
two-launcher run and this machine's figures; the exercises' checker is
tests/test_exercise_answers_ch1011.py."""
import dataclasses
import itertools
import json
import statistics

import pytest

from labs.collectives import alpha_beta
from labs.dims import ParallelDims
from labs.hardware import boundary, latency, machine, placement as P
from labs.pipeline.stage_balance import stage_layers

NUMEL = 1020  # fp32, divisible by 2, 3 and 4, so the ring sends equal chunks


def placed(order=P.ORDER, gpus_per_node=8, **degrees):
    return P.Placement(ParallelDims(**degrees, order=order), gpus_per_node=gpus_per_node)


def test_tp_crosses_in_the_reversed_order_only():
    """TP with 4x the bytes, nodes of 2: counted by destination == the calculator, in both orders;
    which group crosses the node boundary flips with the order."""
    numel = {"tp": 4 * NUMEL, "cp": NUMEL, "pp": NUMEL, "dp": NUMEL}
    totals = []
    for order in (P.ORDER, tuple(reversed(P.ORDER))):
        r = boundary.count(placed(order, 2, tp=2, dp=2), numel)
        assert r["counted"] == r["formula"], order
        totals.append(r)
    assert totals[0]["counted"]["tp"] == 0 < totals[1]["counted"]["tp"]
    assert totals[1]["counted"]["dp"] == 0 < totals[0]["counted"]["dp"]
    # a bookkeeping check, not a finding: the crossing bytes are TP's alone in one order and DP's alone
    # in the other, so their ratio is the 4 chosen in `numel` above
    assert sum(totals[1]["counted"].values()) == 4 * sum(totals[0]["counted"].values())


def test_a_ring_over_whole_nodes_uses_every_nic_of_the_node():
    """Reversed, a DP group of Llama 3 405B's layout is 128 consecutive ranks, 16 whole 8-GPU nodes:
    its ring leaves each node through the node's 8 NICs, min(NVLink, 8 x 50 GB/s) = 400 GB/s per GPU
    (`links.ring_bandwidth`, the book's one home for it), not one NIC's 50 GB/s. In Llama 3's order
    each DP member has a node of its own: one NIC. A group of 2 GPUs on each of its nodes gets 2 NICs;
    a PP send uses its GPU's own NIC. The one-port model (every crossing group at 50 GB/s) fails here."""
    from labs.formulas import links
    rev = placed(tuple(reversed(P.ORDER)), tp=8, pp=16, dp=128)
    assert rev.dims.groups("dp")[0] == list(range(128))
    rows = P.plan(P.LLAMA3_405B, rev)
    assert rows["dp"]["bytes_per_s"] == links.ring_bandwidth(16, 8) == 400e9 != P.NDR_IB_BPS
    assert rows["dp"]["seconds"] == pytest.approx(rows["dp"]["bytes_per_rank"] / 400e9)
    assert rows["tp"]["bytes_per_s"] == rows["pp"]["bytes_per_s"] == 50e9     # one GPU per node each
    good = P.plan(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS))
    assert good["dp"]["bytes_per_s"] == good["pp"]["bytes_per_s"] == 50e9
    assert good["tp"]["bytes_per_s"] == 450e9
    assert rows["dp"]["seconds"] == pytest.approx(good["dp"]["seconds"] / 8)
    assert placed(gpus_per_node=4, tp=4, dp=4).bandwidth("dp") == 50e9    # [0, 4, 8, 12]: 1 per node
    assert placed(gpus_per_node=4, tp=2, dp=4).bandwidth("dp") == 100e9   # [0, 2 | 4, 6]: 2 per node
    assert placed(gpus_per_node=4, tp=2, pp=4).bandwidth("pp", "send") == 50e9
    # through plan: PP's sends leave by one NIC even with two of a group's GPUs on a node (as a ring: 100)
    two_per_node = placed(gpus_per_node=2, pp=4, dp=2)
    assert P.plan(P.LLAMA3_405B, two_per_node)["pp"]["bytes_per_s"] == 50e9 != two_per_node.bandwidth("pp")
    # uneven: 6 ranks on nodes of 4 sit 4 + 2; the node with 2 sets the ring (a max() would give 200)
    assert placed(gpus_per_node=4, dp=6).bandwidth("dp") == 100e9


def test_crossing_formula_on_groups_of_three():
    """CP = 3 on nodes of 4: groups [3, 4, 5] and [6, 7, 8] straddle a boundary, each ring with two
    edges across it (3 -> 4 and the wrap 5 -> 3; 7 -> 8 and 8 -> 6). An all-reduce sends 2(n - 1)/n of
    M per edge, 4/3 M: 4 edges give 16/3 M. M per edge (4 M), a ring without its wrap (2 edges, 8/3 M)
    or counting whole groups instead of edges (2 groups) each give another total."""
    p = placed(gpus_per_node=4, tp=1, cp=3, dp=4)
    assert boundary.crossing_formula(p, {"cp": ("all_reduce", 3000)}) == {"cp": 16000}
    # PP's sends follow the chain, with no wrap: 3 -> 4 in [3, 4, 5] and 7 -> 8 in [6, 7, 8] cross,
    # 2 sends; a chain closed into a ring would add 5 -> 3 and 8 -> 6 (4 sends)
    pp = placed(gpus_per_node=4, tp=1, pp=3, dp=4)
    assert pp.dims.groups("pp")[1:3] == [[3, 4, 5], [6, 7, 8]]
    assert boundary.crossing_formula(pp, {"pp": ("send", 10)}) == {"pp": 20}


def test_a_group_within_g_ranks_can_still_straddle_a_node():
    """Delta N <= G is not enough: tp = 2 on nodes of 3 puts [2, 3] across the boundary (counted), and the
    issue's case, cp = 3 on nodes of 4, puts [3, 4, 5] and [6, 7, 8] across (calculator)."""
    p = placed(gpus_per_node=3, tp=2, dp=2)        # nodes {0, 1, 2}, {3}
    assert p.group_nodes("tp") == [1, 2] and p.tier("tp") == "inter"
    r = boundary.count(p, NUMEL)
    assert r["counted"] == r["formula"] and r["counted"]["tp"] == 2 * 4 * NUMEL   # ranks 2 and 3 each send M
    big = placed(gpus_per_node=4, tp=1, cp=3, dp=4)
    assert big.dims.groups("cp")[1] == [3, 4, 5] and big.group_nodes("cp") == [1, 2, 2, 1]
    assert big.tier("cp") == "inter"


def test_every_group_stays_inside_exactly_when_delta_n_divides_g():
    """The closed-form rule against the group-by-group count, over many layouts that fill their nodes."""
    for tp, cp, pp, dp in itertools.product((1, 2, 3), (1, 2, 3), (1, 2, 4), (1, 2, 3)):
        for g in (2, 3, 4, 6, 8):
            d = ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp)
            if d.world_size % g:
                continue
            for axis in P.LLAMA3_ORDER:
                n = d.size(axis)
                rule = n == 1 or g % (d.stride(axis) * n) == 0
                assert (max(d.group_nodes(axis, g)) == 1) == rule, (tp, cp, pp, dp, g, axis)


def test_straddling_groups_are_inter_node_wherever_the_tier_is_asked():
    """The one rule everywhere: the planner's tiers (chapter 14) agree with the calculator's, group by
    group, for the cases the older stride rule (Delta N <= G means inside) got wrong: PP = 2 beside
    TP = 8 on a 72-GPU NVLink domain, CP = 3 on nodes of 4, TP = 2 with PP = 3 on nodes of 8."""
    from labs.formulas.planning import traffic
    for degrees, g, axis in ((dict(tp=8, pp=2, dp=9), 72, "pp"), (dict(cp=3, dp=4), 4, "cp"),
                             (dict(tp=2, pp=3, dp=4), 8, "pp")):
        d = ParallelDims(**degrees)
        tiers = (d.tier(axis, g), traffic.tiers(d, g)[axis], P.Placement(d, g).tier(axis))
        assert tiers == ("inter",) * 3, degrees
    assert traffic.tiers(ParallelDims(tp=8, pp=9, dp=8), 72)["pp"] == "intra"    # 8 x 9 = 72 divides 72


def test_llama3_stage_split_and_the_busiest_stage():
    # section 3.3.2: one layer fewer on the first and last stages; 126 // 16 = 7 on every stage would
    # leave 14 layers unplaced
    split = [len(layers) for layers in stage_layers(126, 16)]
    assert split == [7] + [8] * 14 + [7] and sum(split) == 126
    assert [len(x) for x in stage_layers(126, 16, 8)] == split   # v = 8: one layer a chunk, the ends empty
    good = P.plan(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS))
    bad = P.plan(P.LLAMA3_405B, placed(tuple(reversed(P.ORDER)), tp=8, pp=16, dp=128))
    assert good["tp"]["tier"] == "intra" and bad["tp"]["tier"] == "inter"
    assert good["pp"]["tier"] == good["dp"]["tier"] == "inter"
    per_layer_and_microbatch = 4 * 2 * 7 / 8 * good["tp"]["payload_bytes"]
    assert good["tp"]["bytes_per_rank"] / per_layer_and_microbatch / 16 == max(split) == 8
    e = P.exposed(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS))
    assert e["pp_critical_sends"] == 2 * (16 * 8 - 1) and e["pp_sends_per_step"] == 2 * 8 * 16
    assert e["pods_per_group"]["dp"] > 1 == e["pods_per_group"]["pp"]


def test_llama3_data_parallel_traffic_is_a_bf16_gather_and_an_fp32_reduce_scatter():
    """Section 3.3.2: FSDP without reshard after forward, gradients reduce-scattered in fp32: 2 + 4
    bytes per parameter of the average stage, (n - 1)/n of each; a bf16 all-reduce (4 bytes) or an fp32
    all-reduce (8) would miss."""
    dp = P.plan(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS))["dp"]
    per_rank = P.LLAMA3_405B.params() // (8 * 16)
    assert dp["bytes_per_rank"] == 6 * per_rank * 127 / 128
    assert dp["kind"] == "all_gather + reduce_scatter" and 18.8e9 < dp["bytes_per_rank"] < 18.9e9


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="positive integer"):
        ParallelDims(tp=0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        placed(gpus_per_node=0, tp=2)
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layers(126, 16, 9)
    with pytest.raises(ValueError, match="8-byte"):
        latency.measure(sizes=(1024,))
    with pytest.raises(ValueError, match="exactly 2 ranks"):
        latency.main(["--world-size", "3"])
    with pytest.raises(ValueError, match="exactly 2 ranks"):  # cli.main prints it as one line
        machine.main(["--world-size", "3"])


def test_placement_cli(capsys):
    P.main(["--reversed", "--json"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]["tp"]["tier"] == "inter"
    with pytest.raises(ValueError, match="cannot fill"):
        P.main(["--tp", "1", "--pp", "100", "--dp", "1"])      # 100 stages x 8 chunks for 126 layers


def test_chapters_11_and_14_count_the_same_tp_and_pp_bytes():
    """One formula table (`labs.formulas.costs`), one stage split, one degrees type: the calculator's TP and
    PP bytes for a middle stage of Llama 3 405B equal the planner's (`planning.traffic`) for the same
    layout, b, m and v, without the planner's vocabulary terms (a middle stage has none)."""
    from labs.formulas.planning import memory, traffic
    run = P.LLAMA3_RUN
    calc = P.plan(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS), run)
    plan = memory.Plan(P.LLAMA3_DIMS, zero=1, micro_batch=run.micro_batch, v=run.v)
    planner = traffic.predict_bytes_per_group(P.LLAMA3_405B, plan, num_microbatches=run.micro_batches,
                                              stage=8)
    assert planner["terms"]["tp_vocab"] == 0 and planner["tp"] == calc["tp"]["bytes_per_rank"]
    assert planner["pp"] == calc["pp"]["bytes_per_rank"]


def test_dp_exposes_one_chunk_each_way_and_the_micro_batch_split_sets_only_the_send_size():
    """DP's exposed time is the first chunk's gather plus the last chunk's reduce-scatter, 1/v of each;
    the other chunks' pieces hide in a window of p chunk passes and p sends (a rank's consecutive
    local chunks are p model chunks apart). All recomputed here from Llama 3 405B's inputs with
    independent arithmetic. The bytes depend on b m alone, each PP send (and the critical path) on b.
    Swapping PP and DP puts PP's waited-for sends, and 1,024 ring edges per pod, across pods."""
    import dataclasses
    e = P.exposed(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS))
    psi, s, h, tp, pp, dp, v, flops, port = P.LLAMA3_405B.params(), 8192, 16384, 8, 16, 128, 8, 400e12, 50e9
    # one micro-batch (one sequence) through one chunk of one GPU: 2 psi FLOPs per token forward, 4 back
    chunk_back = 4 * psi / (pp * v) * s / tp / flops
    send = s * h * 2 / tp / port                                  # bf16 activation, 1/tp of it per TP rank
    assert e["window_backward_s"] == pytest.approx(pp * (chunk_back + send))
    assert e["window_backward_s"] == pytest.approx(0.530, rel=1e-3)   # ~16 x (32.5 + 0.67) ms
    # a chunk's fp32 reduce-scatter and bf16 gather over a 128-rank ring at one port
    shard = psi // (tp * pp) / v * (dp - 1) / dp
    assert e["chunk_reduce_s"] == pytest.approx(4 * shard / port)
    assert e["dp_exposed_s"] == pytest.approx(6 * shard / port)
    assert e["chunk_reduce_share"] == pytest.approx(4 * shard / port / (pp * (chunk_back + send)))
    assert e["chunk_reduce_share"] < 0.1 and e["dp_exposed_s"] < e["pp_critical_s"]
    # the forward window and the gather's share of it, pinned like the backward's: a window without
    # its sends (16 x 16.2 ms) or a gather share over the backward window (3 %, not 6 %) fails
    chunk_fwd = 2 * psi / (pp * v) * s / tp / flops
    assert e["window_forward_s"] == pytest.approx(pp * (chunk_fwd + send))
    assert e["window_forward_s"] == pytest.approx(0.2705, rel=1e-3)   # ~16 x (16.2 + 0.67) ms
    assert e["chunk_gather_s"] == pytest.approx(2 * shard / port)
    assert e["chunk_gather_share"] == pytest.approx(2 * shard / port / (pp * (chunk_fwd + send)))
    # PP and DP share the GPU's NIC in this order: each of the backward chain's pv - 1 sends at half
    # the port adds up to one send's time; a slower PP only widens the gap to DP's exposed time
    assert e["pp_shared_nic_extra_s"] == pytest.approx((pp * v - 1) * send)
    # outermost, DP crosses the 1:7 uplinks: even at a seventh of the port a chunk's reduce-scatter
    # still fits in its window, so only the exposed pair would grow
    assert 7 * e["chunk_reduce_share"] < 1
    # latencies on the critical path: one per waited-for send, 2(pv - 1); one per ring step of the
    # exposed gather and reduce-scatter, 2(dp - 1). Equal here only because pv = dp = 128: Table 4's
    # 8,192-GPU row (DP 64) gives DP 126 against PP's 254
    assert e["pp_critical_latencies"] == 2 * (pp * v - 1) == 254
    assert e["dp_exposed_latencies"] == 2 * (dp - 1) == 254
    dp64 = P.exposed(P.LLAMA3_405B, placed(tp=8, pp=16, dp=64))
    assert (dp64["pp_critical_latencies"], dp64["dp_exposed_latencies"]) == (2 * (pp * v - 1), 2 * 63)
    assert e["pp_critical_crossing_pods"] == 0
    # Llama 3's order: each of the 128 DP groups spans 6 pods and has one ring edge leaving each;
    # 128 flows fit in a pod's uplinks, 3,072 / 7 ports' worth
    assert e["pod_edges"] == {"tp": 0, "cp": 0, "pp": 0, "dp": 16384 // dp}
    assert 128 < 3072 / 7 == e["pod_uplink_ports"]
    swapped = P.exposed(P.LLAMA3_405B, placed(("tp", "cp", "ep", "dp", "pp"), tp=8, pp=16, dp=128))
    # swapped, PP's stride is tp dp = 1,024, so a pod of 3,072 holds 3 members in a row: pods
    # [0,0,0,1,1,1,2,2,2,3,3,3,4,4,4,5]; of the ring's 16 edges those after members 2, 5, 8, 11, 14
    # and the wrap 15 -> 0 cross, 6. The chain's 127 boundaries, boundary c on edge c mod 16, run 7
    # times round (42 crossings) and then over edges 0-14 (5 more): 47 each way, 94. Without the
    # wrap, 5 per round: 40 each way, 80
    assert swapped["pp_critical_crossing_pods"] == 94
    assert swapped["pod_edges"] == {"tp": 0, "cp": 0, "pp": 16384 // pp, "dp": 0}   # one per PP group
    base = P.plan(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS))
    run = dataclasses.replace(P.LLAMA3_RUN, micro_batch=4, micro_batches=4)
    four = P.plan(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS), run)
    assert all(four[a]["bytes_per_rank"] == base[a]["bytes_per_rank"] for a in ("tp", "pp", "dp"))
    assert P.exposed(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS), run)["pp_critical_s"] == pytest.approx(
        4 * e["pp_critical_s"])


def test_outer_position_prices_only_what_the_order_changes():
    """PP's chain and DP's exposed pair leave the node in either order; the outer position changes
    only PP's 94 cross-pod sends (PP outermost) or DP's exposed pair (DP outermost), each at the rate
    the uplinks leave it, the inner group at the full port. Recomputed by hand: at the full port the
    two orders cost the same; at a seventh, DP outermost 7 x 47.2 + 94 x 0.67 ms against
    47.2 + 7 x 94 x 0.67 ms; shared evenly, DP's 128 flows fit in 3,072 / 7 ports' worth (rate 1) and
    PP's 1,024 get 3/7 of a port each. Pricing PP's whole 254-send chain, or DP's pair at the full
    port when outermost, gives other numbers."""
    dp_out = P.exposed(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS))
    pp_out = P.exposed(P.LLAMA3_405B, placed(("tp", "cp", "ep", "dp", "pp"), tp=8, pp=16, dp=128))
    o = P.outer_position(dp_out, pp_out)
    send, pair = 8192 * 16384 * 2 / 8 / 50e9, dp_out["dp_exposed_s"]     # one PP send; DP's pair, bound
    cross = 94 * send
    up = {k: {x: v[x.replace("_s", "_upper_s")] for x in ("dp_outermost_s", "pp_outermost_s")}
          for k, v in o.items()}
    assert up["full"]["dp_outermost_s"] == pytest.approx(pair + cross) == up["full"]["pp_outermost_s"]
    assert up["slowed"]["dp_outermost_s"] == pytest.approx(7 * pair + cross)          # not pair + cross
    assert up["slowed"]["pp_outermost_s"] == pytest.approx(pair + 7 * cross)          # not 7 x 254 sends
    assert o["slowed"]["pp_cross_s"] < 7 * dp_out["pp_critical_s"] / 2
    assert (o["shared"]["rate_dp"], o["shared"]["rate_pp"]) == pytest.approx((1, 3 / 7))
    assert up["shared"]["pp_outermost_s"] == pytest.approx(pair + cross * 7 / 3)
    real = P.exposed_pair(pp_out)
    assert o["shared"]["pp_outermost_s"] == pytest.approx(real + cross * 7 / 3)
    # the price the page prints, DP outermost: its real pair plus PP's in-pod sends at the full port in
    # every row (PP's sends priced at the uplink rate there would add 6 x 94 sends at a seventh)
    for k in ("full", "slowed", "shared"):
        assert o[k]["dp_outermost_s"] == pytest.approx(o[k]["dp_exposed_s"] + cross)
    # DP outermost at a seventh: a chunk's reduce-scatter still fits in its window (hidden)
    assert o["slowed"]["chunk_reduce_share"] == pytest.approx(7 * dp_out["chunk_reduce_share"])
    assert o["slowed"]["chunk_reduce_share"] < 1


def _pod_edges_without_wrap(dims, axis, pod):
    """`placement.pod_edges` as it would be if the ring's wrap-around edge were dropped."""
    out = {}
    for group in dims.groups(axis):
        for a, b in zip(group, group[1:]):
            if a // pod != b // pod:
                out[a // pod] = out.get(a // pod, 0) + 1
    return max(out.values(), default=0)


def test_pod_edges_count_the_wrap_around_edge():
    """PP = 3, DP = 2, pods of 2 GPUs: PP groups [0, 1, 2] and [3, 4, 5], pods {0, 1}, {2, 3}, {4, 5}.
    Edges leaving a pod: 1 -> 2 and the wrap 2 -> 0 (first group), 3 -> 4 and the wrap 5 -> 3 (second).
    Pod 1 sends 2 -> 0 and 3 -> 4: 2 edges; without the wraps no pod sends more than 1. Dropping the
    wrap would also turn the swapped Llama 3 layout's 94 crossings into 80 (above)."""
    d = ParallelDims(pp=3, dp=2)
    assert d.groups("pp") == [[0, 1, 2], [3, 4, 5]]
    assert P.pod_edges(d, "pp", pod=2) == 2
    assert _pod_edges_without_wrap(d, "pp", 2) == 1            # the variant without the wrap fails
    # on Llama 3's swapped layout the wrap does not change the busiest pod's count, hence the small case
    swapped = ParallelDims(tp=8, pp=16, dp=128, order=("tp", "cp", "ep", "dp", "pp"))
    assert P.pod_edges(swapped, "pp") == _pod_edges_without_wrap(swapped, "pp", 3072) == 1024
    # but it does change the chain's crossings: 94 with it (pinned above), 80 without
    pods = [r // 3072 for r in swapped.groups("pp")[0]]
    no_wrap = 2 * sum(c % 16 < 15 and pods[c % 16] != pods[c % 16 + 1] for c in range(16 * 8 - 1))
    assert no_wrap == 80 != P.exposed(P.LLAMA3_405B, P.Placement(swapped))["pp_critical_crossing_pods"]


def _fake_ranks(times0, times1, sizes=(8,)):
    """Two ranks' `latency.rank_times` output with made-up seconds: variant ``pattern/start``'s tries
    at every size given by ``times0[variant]`` on rank 0 and ``times1[variant]`` on rank 1."""
    keys = [(f"{k}/{s}", n) for k in latency.PATTERNS for s in latency.STARTS for n in sizes]
    return [{f"{v}/{n}": list(times[v]) for v, n in keys} for times in (times0, times1)]


US = 1e-6
# made-up round trips (ping-pong) and exchanges, in us, each variant its own: the starts and the
# patterns differ, so a statistic taken from the wrong variant, or pooled over two, changes value
# Each rank's own fastest try is not at the same try as the other's (rank 1's fastest ping-pong at
# try 2 of 5 lies under rank 0's 300; rank 0's fastest exchange at try 5 under rank 1's 300), so the
# slower of the two ranks' own fastest (80 -> 40, and 145) differs from the fastest slower try.
FAKE0 = {"pingpong/barrier": [100, 300, 80, 400, 200], "pingpong/back_to_back": [40, 3000, 9000, 6000, 1000],
         "exchange/barrier": [150, 160, 170, 900, 145], "exchange/back_to_back": [130, 700, 800, 1000, 2000]}
FAKE1 = {"pingpong/barrier": [120, 70, 90, 500, 260], "pingpong/back_to_back": [30, 2000, 9500, 5000, 1200],
         "exchange/barrier": [140, 180, 165, 100, 300], "exchange/back_to_back": [125, 650, 900, 1100, 1800]}


def _fake_summary(tick=4e-3):
    scaled = [{v: [t * US for t in ts] for v, ts in fake.items()} for fake in (FAKE0, FAKE1)]
    return latency.summarize(_fake_ranks(*scaled), [8], 5, tick=tick)


def test_latency_halves_the_ping_pong_takes_the_slower_rank_and_keeps_every_variant_apart():
    """Made-up tries: the ping-pong is halved, the exchange is not; each try is the slower rank's;
    every variant (pattern and start) has its own fastest, median and quartiles; the latency alpha is
    the fastest exchange after a barrier, not the fastest over both starts nor the ping-pong's."""
    r = _fake_summary()
    # slower rank per try, ping-pong after a barrier: round trips 120, 300, 90, 500, 260 -> one way
    # 60, 150, 45, 250, 130: fastest 45 (not halved: 90; rank 0 alone: 40), median 130, quartiles 60, 150
    want = {"pingpong/barrier": (45, 130, 60, 150),
            # back to back: 40, 3000, 9500, 6000, 1200 -> 20, 1500, 4750, 3000, 600
            "pingpong/back_to_back": (20, 1500, 600, 3000),
            # exchange, not halved: 150, 180, 170, 900, 300 (rank 0 alone: min 145, rank 1 alone 100)
            "exchange/barrier": (150, 180, 170, 300),
            # back to back: 130, 700, 900, 1100, 2000
            "exchange/back_to_back": (130, 900, 700, 1100)}
    for v, (fastest, median, q1, q3) in want.items():
        got = r["small"][v]
        assert (got["fastest_s"], got["median_s"], got["q1_s"], got["q3_s"]) == pytest.approx(
            (fastest * US, median * US, q1 * US, q3 * US)), v      # q1, q3 swapped would fail
    # alpha and the one-way ping-pong are after a barrier only: the back-to-back starts hold faster
    # tries (130 and 20), so pooling the starts would give other values; swapped, the ratio inverts
    assert r["alpha_s"] == pytest.approx(150 * US) and r["one_way_s"] == pytest.approx(45 * US)
    assert r["alpha_over_one_way"] == pytest.approx(150 / 45)
    assert r["exchange_fastest_by_size"] == pytest.approx({8: 150 * US})   # the slower rank's, per size
    one_way = [t * US for t in (20, 1500, 4750, 3000, 600)]
    assert r["tries_s"]["pingpong/back_to_back"] == pytest.approx(one_way)


def test_latency_tick_share_counts_each_variants_whole_tries_of_a_quarter_tick():
    """A 16 ms tick: of the back-to-back ping-pong's round trips (slower rank) 40, 3000, 9500, 6000 and
    1200 us, two reach its quarter, 4 ms: 0.4. One-way times (20 ... 4750 us) would give 0.2, a whole
    tick none (the waits it misses); at a 4 ms tick four of five. Each variant has its own share: at
    4 ms the back-to-back exchanges (130, 900, 700, 1100, 2000 us) give 0.4, the tries after a barrier
    none, so a share taken from another variant, or pooled, fails."""
    assert _fake_summary(tick=16e-3)["quarter_tick_share"]["pingpong/back_to_back"] == pytest.approx(0.4)
    share = _fake_summary(tick=4e-3)["quarter_tick_share"]
    assert share == pytest.approx({"pingpong/back_to_back": 0.8, "exchange/back_to_back": 0.4,
                                   "pingpong/barrier": 0.0, "exchange/barrier": 0.0})


def test_latency_across_jobs_gives_each_variant_its_own_range_and_one_size_fits_nothing():
    """Made-up jobs: per variant the range of the fastest and of the median over the jobs, the range
    of alpha over the one-way ping-pong and of each variant's tick share; a job of the 8-byte size
    alone fits no line."""
    assert _fake_summary()["alpha_fits"] == {}
    third = _fake_summary(tick=4e-3)                       # every time doubled, another ratio
    third["small"] = {v: {k: 2 * x for k, x in s.items()} for v, s in third["small"].items()}
    third["alpha_over_one_way"] = 5.0
    # the largest job in the middle and the smallest share last: a range taken from the first job to
    # the last, instead of the smallest to the largest, fails every line below
    jobs = iter([_fake_summary(tick=4e-3), third, _fake_summary(tick=16e-3)])
    r = latency.across_jobs(jobs=3, run=lambda: next(jobs))
    assert r["jobs"] == 3 and r["quarter_tick_share"]["pingpong/back_to_back"] == pytest.approx((0.4, 0.8))
    assert r["small"]["pingpong/barrier"]["fastest"] == pytest.approx((45 * US, 90 * US))
    assert r["small"]["pingpong/back_to_back"]["median"] == pytest.approx((1500 * US, 3000 * US))
    assert r["small"]["exchange/barrier"]["median"] == pytest.approx((180 * US, 360 * US))
    assert r["alpha_over_one_way"] == pytest.approx((150 / 45, 5.0))
    # and per job, in order: a count of jobs below some ratio needs each job's, not the range's ends
    assert r["alpha_over_one_way_each"] == pytest.approx([150 / 45, 5.0, 150 / 45])


def test_latency_quartiles_at_an_even_count_of_tries():
    """Four tries, 100 to 400 us on both ranks: the inclusive quartiles interpolate, 175, 250 and 325
    us; a nearest-rank median and quartiles (sorted[n // 4], [n // 2], [3n // 4]: 200, 300, 400), which
    five tries cannot tell apart, fail here, as the lab's 20 tries would show."""
    tries = {v: [t * US for t in (400, 100, 300, 200)] for v in FAKE0}
    r = latency.summarize(_fake_ranks(tries, tries), [8], 4, tick=4e-3)["small"]["exchange/barrier"]
    assert (r["q1_s"], r["median_s"], r["q3_s"], r["fastest_s"]) == pytest.approx(
        (175 * US, 250 * US, 325 * US, 100 * US))


def test_latency_checks_alpha_against_every_larger_size_each_job():
    """Two sizes: the 1024-byte exchanges after a barrier are made up faster than the 8-byte ones, so
    alpha is an upper bound. A by-size table that read the 8-byte tries for every size (the check then
    never fires), or took rank 0's time instead of the slower rank's, fails; so does a job list that
    flagged every job alike."""
    scaled = [{v: [t * US for t in ts] for v, ts in fake.items()} for fake in (FAKE0, FAKE1)]
    ranks = _fake_ranks(*scaled, sizes=(8, 1024))
    for rank, fastest_try in zip(ranks, (90, 120)):                # slower rank: 120 at try 1
        rank["exchange/barrier/1024"] = [fastest_try * US, *[5000 * US] * 4]
    r = latency.summarize(ranks, [8, 1024], 5, tick=4e-3)
    assert r["exchange_fastest_by_size"] == pytest.approx({8: 150 * US, 1024: 120 * US})
    assert latency.upper_bound(r) and not latency.upper_bound(_fake_summary())
    jobs = iter([_fake_summary(), r, _fake_summary()])
    r = latency.across_jobs(jobs=3, run=lambda: next(jobs))
    assert r["alpha_upper_bound"] == [False, True, False] and r["alpha_s"] == pytest.approx([150 * US] * 3)


def test_one_ranks_own_pair_is_a_lower_bound_equal_on_the_printed_layouts():
    """Two readings of what DP exposes: the largest gather overrun plus the largest reduce-scatter
    overrun, possibly from two ranks (`exposed_pair`, the chapter's: a gather overrun delays micro-batch
    0's chain, a reduce-scatter overrun the step's end, whichever ranks they are on), and one rank's
    own gather plus reduce-scatter overrun, the largest over ranks, which can only be smaller. On the
    layouts the chapter prints, 16,384 and 8,192 GPUs, at the full port and at a seventh of it, the two
    are equal; on the dropdown's rows with whole activations sent they differ by under 0.2 ms against
    sums of hundreds (the page prints whole milliseconds), so no printed number depends on which."""
    def single(e, rate=1.0):
        over = lambda k, x, w: max(0.0, k * e[x] / rate - w)
        return max(over(k, "chunk_gather_s", f) + over(k, "chunk_reduce_s", b) for k, f, b in e["dp_ranks"])
    run64 = dataclasses.replace(P.LLAMA3_RUN, micro_batches=32)
    layouts = [P.exposed(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS)),
               P.exposed(P.LLAMA3_405B, placed(("tp", "cp", "pp", "dp"), tp=8, pp=16, dp=64), run64, 430e12)]
    for e in layouts:
        for rate in (1.0, 1 / 7):
            assert P.exposed_pair(e, rate) == pytest.approx(single(e, rate), rel=1e-12)
    whole = dataclasses.replace(P.LLAMA3_RUN, pp_send_split=False)
    f16k = P.LLAMA3_FLOPS_PER_GPU
    for dp, run, flops in ((128, whole, f16k), (128, dataclasses.replace(whole, v=4), f16k),
                           (64, dataclasses.replace(whole, micro_batches=32), 430e12)):
        for order in (("tp", "cp", "pp", "dp"), ("tp", "cp", "dp", "pp")):
            e = P.exposed(P.LLAMA3_405B, placed(order, tp=8, pp=16, dp=dp), run, flops)
            for rate in (1.0, 1 / 7):
                assert 0 <= P.exposed_pair(e, rate) - single(e, rate) < 2e-4


def test_exposed_pair_is_the_largest_over_ranks():
    """DP's exposed pair by the chapter's windows: rank r's first chunk is chunk r, with chunks 0..r-1 and r
    sends before its first gather and after its last reduce-scatter; chunk 0 is the embedding alone, a
    lookup counted as no compute, and rank 0's chunk is that size. So rank 1's slack is one send, and its
    overruns are the largest of both kinds at the full port and at a seventh. The mistakes: the
    embedding chunk priced as a full layer (rank 1 then hides and rank 0's pair looks largest), the
    average pair with no slack (an upper bound), rank 0 alone, the slack left out, and one rank's own
    pair (a lower bound) where the largest gather overrun and the largest reduce-scatter overrun sit on
    different ranks."""
    e = P.exposed(P.LLAMA3_405B, P.Placement(P.LLAMA3_DIMS))
    g, r, s = e["chunk_gather_s"], e["chunk_reduce_s"], e["pp_send_s"]
    cf, cb = e["chunk_forward_s"], e["chunk_backward_s"]
    emb = P.LLAMA3_405B.vocab * P.LLAMA3_405B.hidden / 8 / (P.LLAMA3_405B.params() / (8 * 16 * 8))
    slack = [x for w in e["dp_ranks"][:3] for x in w[1:]]               # chunk 0's passes: no compute
    assert slack == pytest.approx([0, 0, s, s, cf + 2 * s, cb + 2 * s])
    full = P.exposed_pair(e)
    assert full == pytest.approx((g - s) + (r - s))                     # rank 1's, less one send each
    # the embedding chunk priced as a full layer: rank 1 hides and rank 0's embedding pair is the max
    layer = dict(e, dp_ranks=[(k, i * (cf + s), i * (cb + s)) for i, (k, *_) in enumerate(e["dp_ranks"])])
    assert P.exposed_pair(layer) == pytest.approx(emb * (g + r))
    assert full != pytest.approx(P.exposed_pair(layer)) and full != pytest.approx(emb * (g + r))
    assert full < e["dp_exposed_s"]                                      # below the bound
    slowed = P.exposed_pair(e, 1 / 7)
    assert slowed == pytest.approx((7 * g - s) + (7 * r - s))           # rank 1's, less its slack
    assert slowed != pytest.approx(P.exposed_pair(layer, 1 / 7))        # not with chunk 0 a layer
    assert slowed != pytest.approx(7 * emb * (g + r))                            # not rank 0 alone
    assert slowed < 7 * e["dp_exposed_s"]                                        # below the bound
    # a rank whose gather overruns and another whose reduce-scatter does: the step waits for both
    two = dict(e, chunk_gather_s=5.0, chunk_reduce_s=8.0, dp_ranks=[(1.0, 0.0, 10.0), (1.0, 10.0, 0.0)])
    assert P.exposed_pair(two) == 5.0 + 8.0 != 8.0                      # not one rank's own pair
    # one rank whose forward slack (2) and backward slack (6) differ: the gather overruns its forward
    # slack, 3, the reduce-scatter its backward slack, 2; the slacks swapped would give 0 + 6
    uneven = dict(e, chunk_gather_s=5.0, chunk_reduce_s=8.0, dp_ranks=[(1.0, 2.0, 6.0)])
    assert P.exposed_pair(uneven) == 3.0 + 2.0 != 6.0
    # DP 64: the reversal holds by the largest over ranks and by the bound
    run64 = dataclasses.replace(P.LLAMA3_RUN, micro_batches=32)
    lay = lambda order: placed(order, tp=8, pp=16, dp=64)
    o = P.outer_position(P.exposed(P.LLAMA3_405B, lay(("tp", "cp", "pp", "dp")), run64, 430e12),
                         P.exposed(P.LLAMA3_405B, lay(("tp", "cp", "dp", "pp")), run64, 430e12))["slowed"]
    assert o["dp_outermost_s"] > o["pp_outermost_s"] and o["dp_outermost_upper_s"] > o["pp_outermost_upper_s"]


# made-up lines over sizes, in us and us per byte, per variant: (fastest, median) each (alpha, beta);
# the ping-pong's are round trips (summarize halves them). Every variant and statistic has its own
# intercept, so a fit through another pattern, start or statistic gives another alpha
LINES = {"pingpong/barrier": ((80, 0.002), (400, 0.004)),
         "pingpong/back_to_back": ((30, 0.001), (900, 0.006)),
         "exchange/barrier": ((50, 0.001), (120, 0.002)),
         "exchange/back_to_back": ((20, 0.003), (300, 0.005))}
FIT_SIZES = [8, 1024, 16 * 1024, 64 * 1024]


def _line_ranks():
    """Per variant and size, five tries whose slower-rank fastest and median lie exactly on that
    variant's lines: rank 0's tries are (m, 0.9 f, 3 m, 1.5 m, 1.1 f), rank 1's half of them but f
    for the second, so the slower rank's are (m, f, 3 m, 1.5 m, 1.1 f): fastest f, median m, while
    rank 0 alone has fastest 0.9 f and rank 1 alone 0.55 f."""
    ranks = [{}, {}]
    for v, ((fa, fb), (ma, mb)) in LINES.items():
        for n in FIT_SIZES:
            f, m = (fa + fb * n) * US, (ma + mb * n) * US
            rank0 = [m, 0.9 * f, 3 * m, 1.5 * m, 1.1 * f]
            ranks[0][f"{v}/{n}"] = rank0
            ranks[1][f"{v}/{n}"] = [t / 2 for t in rank0[:1]] + [f] + [t / 2 for t in rank0[2:]]
    return ranks


def test_latency_alpha_fits_take_the_exchange_after_a_barrier_fastest_and_median_apart():
    """Made-up tries on known lines over four sizes: the intercepts are the exchange's after a
    barrier, exactly 50 us through the fastest tries and 120 us through the medians (the same fit's
    slopes, which summarize does not report, are exactly 0.001 and 0.002 us per byte). Fitting the
    ping-pong (40 or 80 us, halved or not), the back-to-back start (20 us), swapping fastest and
    median (120 and 50), or one rank's tries (45 or 27.5 us) each gives another value."""
    r = latency.summarize(_line_ranks(), FIT_SIZES, 5, tick=4e-3)
    fits = r["alpha_fits"]
    assert set(fits) == {"exchange/barrier/fastest", "exchange/barrier/median"}
    assert fits["exchange/barrier/fastest"] == pytest.approx(50 * US, rel=1e-9)
    assert fits["exchange/barrier/median"] == pytest.approx(120 * US, rel=1e-9)
    # each named mistake, computed the wrong way here, lands on another intercept
    ranks = _line_ranks()
    fit = lambda tries: alpha_beta.fit_line(FIT_SIZES, tries)["alpha"] / US
    slower = lambda v, n, half=1: [max(a, b) / half
                                   for a, b in zip(ranks[0][f"{v}/{n}"], ranks[1][f"{v}/{n}"])]
    wrong = {"ping-pong, halved": fit([min(slower("pingpong/barrier", n, 2)) for n in FIT_SIZES]),
             "ping-pong, not halved": fit([min(slower("pingpong/barrier", n)) for n in FIT_SIZES]),
             "exchange back to back": fit([min(slower("exchange/back_to_back", n)) for n in FIT_SIZES]),
             "median for fastest": fit([statistics.median(slower("exchange/barrier", n)) for n in FIT_SIZES]),
             "rank 0 alone": fit([min(ranks[0][f"exchange/barrier/{n}"]) for n in FIT_SIZES]),
             "rank 1 alone": fit([min(ranks[1][f"exchange/barrier/{n}"]) for n in FIT_SIZES])}
    assert wrong == pytest.approx({"ping-pong, halved": 40, "ping-pong, not halved": 80,
                                   "exchange back to back": 20, "median for fastest": 120,
                                   "rank 0 alone": 45, "rank 1 alone": 27.5})
    assert all(abs(a - 50) > 1 for a in wrong.values())
    wrong_median = fit([min(slower("exchange/barrier", n)) for n in FIT_SIZES])     # fastest for median
    assert wrong_median == pytest.approx(50) != pytest.approx(fits["exchange/barrier/median"] / US)
    for stat, f, slope in (("fastest", min, 0.001), ("median", statistics.median, 0.002)):
        line = alpha_beta.fit_line(FIT_SIZES, [f(slower("exchange/barrier", n)) for n in FIT_SIZES])
        assert line["alpha"] == pytest.approx(fits[f"exchange/barrier/{stat}"], rel=1e-12)
        assert line["beta"] == pytest.approx(slope * US, rel=1e-9)


def test_latency_rank_times_interleaves_and_rotates_the_sizes(monkeypatch):
    """Two sizes, three rounds: every round times every size, and round i starts at size i (mod 2), so
    the smallest message does not always come first, right after the previous round's largest.
    Catches each size's repeats in one block (8, 8, 8 first) and a fixed order (8, 16 every round)."""
    sent = []

    def call(name):
        def f(tensor, peer):
            if name in ("send", "isend"):
                sent.append(tensor.numel())
            if name in ("isend", "irecv"):
                return type("Req", (), {"wait": lambda self: None})()
        return f

    fake = type("Dist", (), {"barrier": staticmethod(lambda: None),
                             **{n: staticmethod(call(n)) for n in ("send", "recv", "isend", "irecv")}})
    monkeypatch.setattr(latency, "dist", fake)
    latency.rank_times(0, 2, [8, 16], 3)
    # rank 0 sends once per try of each of the 4 variants; the warm-up sends once per pattern and size
    assert sent[:4] == [8, 8, 16, 16]
    rounds = sent[4:]
    assert [rounds[k:k + 4] for k in range(0, len(rounds), 4)] == [
        [8] * 4, [16] * 4, [16] * 4, [8] * 4, [8] * 4, [16] * 4]


def test_latency_rank_times_interleaves_the_variants_and_times_only_the_exchange(monkeypatch):
    """`rank_times` against a recording stand-in for torch.distributed and the clock: a barrier takes
    100 s of the fake clock, each message call 1 s. Every try must then take exactly 2 s (the barrier
    outside the timed span, both calls inside it), tries must come round-robin, one per variant per
    repeat, after one untimed warm-up of each pattern, with a barrier before the barrier variants only,
    and an exchange must wait for both its send and its receive. Catches a barrier before every try,
    the loops swapped (a variant's tries in one block), the barrier inside the timed span, and an
    exchange that waits for its send only."""
    clock, calls = [0.0], []

    def call(name, cost=1.0):
        def f(*args, **kwargs):
            calls.append(name)
            clock[0] += cost
            if name in ("isend", "irecv"):
                return type("Req", (), {"wait": lambda self: call(f"wait {name}", 0.0)()})()
        return f

    fake = type("Dist", (), {"barrier": staticmethod(call("barrier", 100.0)),
                             **{n: staticmethod(call(n)) for n in ("send", "recv", "isend", "irecv")}})
    monkeypatch.setattr(latency, "dist", fake)
    monkeypatch.setattr(latency.time, "perf_counter", lambda: clock[0])
    out = latency.rank_times(0, 2, [8], 3)
    pingpong, exchange = ["send", "recv"], ["isend", "irecv", "wait isend", "wait irecv"]
    one_repeat = ["barrier", *pingpong, *pingpong, "barrier", *exchange, *exchange]
    assert calls == pingpong + exchange + 3 * one_repeat
    assert out == {f"{k}/{s}/8": [2.0] * 3 for k in latency.PATTERNS for s in latency.STARTS}
    # rank 1 answers: it receives first, then sends back (both sending first would deadlock)
    calls.clear()
    latency.rank_times(1, 2, [8], 1)
    assert calls[:2] == ["recv", "send"]
