"""Chapter 11: the placement calculator decides group by group and agrees with the bytes counted by
each message's destination; Llama 3's stage split; bad input. Notebook 11 asserts the real
two-launcher run and this machine's figures; the exercises' checker is
tests/test_exercise_answers_ch1011.py."""
import itertools
import json

import pytest

from labs.hardware import boundary, latency, machine, placement as P

NUMEL = 1020  # fp32, divisible by 2, 3 and 4, so the ring sends equal chunks


def test_tp_four_times_chattier_crosses_in_the_reversed_order_only():
    """TP with 4x the bytes, nodes of 2: counted by destination == the calculator, in both orders."""
    numel = {"tp": 4 * NUMEL, "cp": NUMEL, "pp": NUMEL, "dp": NUMEL}
    totals = []
    for order in (P.ORDER, tuple(reversed(P.ORDER))):
        r = boundary.count(P.Placement({"tp": 2, "dp": 2}, gpus_per_node=2, order=order), numel)
        assert r["counted"] == r["formula"], order
        totals.append(r)
    assert totals[0]["counted"]["tp"] == 0 < totals[1]["counted"]["tp"]
    assert sum(totals[1]["counted"].values()) == 4 * sum(totals[0]["counted"].values())


def test_a_group_within_g_ranks_can_still_straddle_a_node():
    """Delta N <= G is not enough: tp = 2 on nodes of 3 puts [2, 3] across the boundary (counted), and the
    issue's case, cp = 3 on nodes of 4, puts [3, 4, 5] and [6, 7, 8] across (calculator)."""
    p = P.Placement({"tp": 2, "dp": 2}, gpus_per_node=3)        # nodes {0, 1, 2}, {3}
    assert p.group_nodes("tp") == [1, 2] and p.tier("tp") == "inter"
    r = boundary.count(p, NUMEL)
    assert r["counted"] == r["formula"] and r["counted"]["tp"] == 2 * 4 * NUMEL   # ranks 2 and 3 each send M
    big = P.Placement({"tp": 1, "cp": 3, "dp": 4}, gpus_per_node=4)
    assert big.groups("cp")[1] == [3, 4, 5] and big.group_nodes("cp") == [1, 2, 2, 1]
    assert big.tier("cp") == "inter"


def test_every_group_stays_inside_exactly_when_delta_n_divides_g():
    """The closed-form rule against the group-by-group count, over many layouts that fill their nodes."""
    for tp, cp, pp, dp in itertools.product((1, 2, 3), (1, 2, 3), (1, 2, 4), (1, 2, 3)):
        for g in (2, 3, 4, 6, 8):
            p = P.Placement({"tp": tp, "cp": cp, "pp": pp, "dp": dp}, gpus_per_node=g)
            if p.world_size % g:
                continue
            for axis in P.ORDER:
                n = p.degrees.get(axis, 1)
                rule = n == 1 or g % (p.stride(axis) * n) == 0
                assert (max(p.group_nodes(axis)) == 1) == rule, (tp, cp, pp, dp, g, axis)


def test_llama3_stage_split_and_the_busiest_stage():
    # section 3.3.2: one layer fewer on the first and last stages; 126 // 16 = 7 on every stage would
    # leave 14 layers unplaced
    split = P.stage_layers(126, 16)
    assert split == [7] + [8] * 14 + [7] and sum(split) == 126
    assert P.stage_layers(126, 1) == [126] and sum(P.stage_layers(30, 4)) == 30
    layout = {"tp": 8, "cp": 1, "pp": 16, "dp": 128}
    good = P.plan(P.LLAMA3_405B, P.Placement(layout))
    bad = P.plan(P.LLAMA3_405B, P.Placement(layout, order=tuple(reversed(P.ORDER))))
    assert good["tp"]["tier"] == "intra" and bad["tp"]["tier"] == "inter"
    assert good["pp"]["tier"] == good["dp"]["tier"] == "inter"
    per_layer_and_microbatch = 4 * 2 * 7 / 8 * good["tp"]["payload_bytes"]
    assert good["tp"]["bytes_per_rank"] / per_layer_and_microbatch / 16 == max(split) == 8
    e = P.exposed(P.LLAMA3_405B, P.Placement(layout))
    assert e["pp_critical_sends"] == 30 and e["pods_per_group"]["dp"] > 1 == e["pods_per_group"]["pp"]


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="positive integer"):
        P.Placement({"tp": 0})
    with pytest.raises(ValueError, match="gpus_per_node"):
        P.Placement({"tp": 2}, gpus_per_node=0)
    with pytest.raises(ValueError, match="cannot fill"):
        P.stage_layers(126, 100)
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
        P.main(["--tp", "1", "--pp", "100", "--dp", "1"])
