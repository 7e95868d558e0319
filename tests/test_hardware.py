"""Chapter 11: the placement calculator against counted bytes, a real two-launcher run, the figures."""
import json
import os
import subprocess
import sys

import pytest

from labs.hardware import machine, placement as P
from labs.launcher import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMEL = 1020  # fp32, divisible by 2, 3 and 4, so the ring sends equal chunks
PAYLOADS = {a: ("send" if a == "pp" else "all_reduce", 4 * NUMEL) for a in P.ORDER}


@pytest.mark.parametrize("degrees,per_node", [({"tp": 2, "pp": 2, "dp": 2}, 2),
                                              ({"tp": 2, "cp": 3}, 2)])
def test_counted_boundary_bytes_match_the_calculator_in_both_orders(degrees, per_node):
    for order in (P.ORDER, tuple(reversed(P.ORDER))):
        p = P.Placement(degrees, gpus_per_node=per_node, order=order)
        ranks = launch.spawn(P.simulate, p.world_size, p, NUMEL)
        counted = {a: sum(r[a] for r in ranks) for a in P.ORDER}
        assert counted == P.crossing_formula(p, PAYLOADS), (order, counted)


def test_llama_order_keeps_tp_inside_the_node_and_reversing_it_costs_time():
    """A plausible bug (tp made slowest) must show: TP leaves NVLink and its time grows 9x."""
    layout = {"tp": 8, "cp": 1, "pp": 16, "dp": 128}
    good = P.plan(P.LLAMA3_405B, P.Placement(layout))
    bad = P.plan(P.LLAMA3_405B, P.Placement(layout, order=tuple(reversed(P.ORDER))))
    assert good["tp"]["tier"] == "intra" and bad["tp"]["tier"] == "inter"
    assert good["pp"]["tier"] == good["dp"]["tier"] == "inter"
    assert good["tp"]["bytes_per_rank"] == bad["tp"]["bytes_per_rank"]  # same bytes, other link
    assert bad["tp"]["seconds"] / good["tp"]["seconds"] == pytest.approx(P.NVLINK4_BPS / P.NDR_IB_BPS)
    # TP bytes: 4 all-reduces of b*s*h*2 per layer per micro-batch, ring 2(n-1)/n.
    m = 8192 * 16384 * 2
    assert good["tp"]["bytes_per_rank"] == 2 * 7 / 8 * m * 4 * (126 // 16) * 16


def test_units():
    assert P.NVLINK4_BPS == 450e9 and P.NDR_IB_BPS == 50e9  # GB/s per direction, not Gb/s


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="positive integer"):
        P.Placement({"tp": 0})
    with pytest.raises(ValueError, match="do not fill nodes"):
        P.Placement({"tp": 3, "dp": 5}, gpus_per_node=8)


def test_two_launchers_equal_one():
    r = machine.two_node_run(["labs.data_parallel.ring_allreduce", "--numel", "1001", "--repeats", "1", "--json"])
    assert sorted(r["reports_per_launcher"]) == [0, 1], "only global rank 0, on one launcher, reports"
    (two,), (one,) = r["two_node"], r["single"]
    assert two["world_size"] == one["world_size"] == 4
    for key in ("bytes_sent", "bytes_received", "max_abs_error", "wire_bytes"):
        assert two[key] == one[key], key  # same ranks, same ring order: bit-identical sums
    assert all("--nnodes=2" in c for c in r["commands"])


def test_cli_prints_the_figures():
    out = subprocess.run([sys.executable, "-m", "labs.hardware.machine", "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    r = json.loads(out.splitlines()[-1])
    # each rate is the bytes the lab moved over the seconds it measured, for the sizes it states
    copy, loop = r["host_copy"], r["gloo_loopback"]
    assert copy["bytes"] == 1 << 26 and copy["bytes_per_s"] == pytest.approx(copy["bytes"] / copy["seconds"])
    assert loop["latency_bytes"] == 8 and loop["bandwidth_bytes"] == 1 << 24
    if not r["gpu"].get("device"):
        assert "no CUDA device" in r["gpu"]["skipped"]
    with pytest.raises(ValueError, match="exactly 2 ranks"):  # cli.main prints it as one line
        machine.main(["--world-size", "3"])


def test_chattier_tp_crosses_more_when_reversed():
    """TP with 4x the bytes: the reversed order must put more bytes on the network, and count them."""
    numel = {"tp": 4 * NUMEL, "cp": NUMEL, "pp": NUMEL, "dp": NUMEL}
    payloads = {a: ("send" if a == "pp" else "all_reduce", 4 * numel[a]) for a in P.ORDER}
    totals = []
    for order in (P.ORDER, tuple(reversed(P.ORDER))):
        p = P.Placement({"tp": 2, "dp": 2}, gpus_per_node=2, order=order)
        ranks = launch.spawn(P.simulate, 4, p, numel)
        counted = {a: sum(r[a] for r in ranks) for a in P.ORDER}
        assert counted == P.crossing_formula(p, payloads)
        totals.append(sum(counted.values()))
    assert totals[1] == 4 * totals[0]


def test_placement_cli(capsys):
    P.main(["--reversed", "--json"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]["tp"]["tier"] == "inter"
    with pytest.raises(ValueError, match="do not fill nodes"):
        P.main(["--tp", "3", "--pp", "1", "--dp", "5"])
