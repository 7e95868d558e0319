"""The library's V-shaped schedules (ZB-V, DualPipeV) simulated on their own order."""
import pytest

from labs.formulas import schedules
from labs.pipeline import v_schedules as vs


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_zb_v_holds_1f1b_memory_and_beats_zb_h1(p, m):
    zbv = vs.summary("zb-v", p, m)
    # Qi et al. §6: ZB-V keeps 1F1B's peak, p micro-batches of a stage, as 2p half-size chunks
    assert zbv["peak_chunks"] == [2 * p] * p and zbv["peak_stage_microbatches"] == [p] * p
    # every rank does 2m chunk micro-batches of F, I and W: 3m stage units of work
    busy = sum(e["end"] - e["start"] for evs in zbv["timeline"] for e in evs)
    assert busy == p * 3 * m
    assert zbv["bubble_fraction"] < schedules.formula("zb-h1", p, m)["over_total"]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_dualpipe_v_runs_and_every_action_once(p, m):
    d = vs.summary("dualpipe-v", p, m)
    kinds = [(e["kind"], e["stage"], e["mb"]) for evs in d["timeline"] for e in evs]
    assert len(kinds) == len(set(kinds))
    # each chunk micro-batch: one F and either a full B or an I and a W
    for stage in range(2 * p):
        for mb in range(m):
            assert ("F", stage, mb) in kinds
            assert ("B", stage, mb) in kinds or {("I", stage, mb), ("W", stage, mb)} <= set(kinds)
    assert 0 < d["bubble_fraction"] < schedules.formula("1f1b", p, m)["over_total"]


def test_a_wrong_order_deadlocks():
    order = vs.library_order("zb-v", 2, 4)
    order[0] = order[0][1:] + order[0][:1]     # rank 0 starts with micro-batch 1: never fed back
    order[1] = list(reversed(order[1]))
    with pytest.raises(ValueError, match="deadlocks"):
        vs.simulate(order)
