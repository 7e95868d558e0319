"""Chapter 14: step-time terms the page states in words, each pinned by a case a plausible slip fails."""
import dataclasses

import pytest

from labs.dims import ParallelDims
from labs.formulas.planning import calibrated, planner, shapes

ETA = calibrated.eta("H100", "bf16")
JOB = planner.Job(shapes.LLAMA2_70B, shapes.DGX_H100, 64, 4 * 2**20)


def _time(job, dims, **fixed):
    return planner.published(job, dims, ETA, fixed)["time"]


def test_zero2_reduces_every_micro_batchs_gradients():
    """ZeRO-2 reduce-scatters each micro-batch's gradients (the page's b = 1 against b = 4 dropdown), so
    at b = 1 (64 micro-batches) its data-parallel term is several times ZeRO-1's, which reduces once
    per step. Catches ZeRO-2 priced as one reduction per step."""
    d = ParallelDims(tp=8, dp=8)
    assert _time(JOB, d, zero=2, micro_batch=1)["dp"] > 3 * _time(JOB, d, zero=1, micro_batch=1)["dp"]


def test_data_parallel_traffic_runs_over_cp_times_dp():
    """The context-parallel ranks hold the same weights, so the gradients are reduced over CP x DP: with
    no overlap to hide it, CP 2 x DP 4 pays the same data-parallel time as DP 8 (the same 8 ranks' ring,
    across the same nodes). Catches the reduction taken over DP alone."""
    plain = dataclasses.replace(JOB, software=JOB.software.with_(overlap_grad_reduce=False,
                                                                 overlap_param_gather=False))
    dp8 = _time(plain, ParallelDims(tp=8, dp=8), zero=1, micro_batch=1)["dp"]
    cp2 = _time(plain, ParallelDims(tp=8, cp=2, dp=4), zero=1, micro_batch=1)["dp"]
    assert cp2 == pytest.approx(dp8, rel=1e-9) and dp8 > 0


def test_pipeline_sends_hide_only_in_the_interleaved_schedule():
    """Megatron-LM overlaps the pipeline's sends only when interleaved (`overlap_p2p_comm = False`
    otherwise): under 1F1B (v = 1) every send is waited for; interleaved (v = 2) the sends hide, and only
    their slowdown of the compute (sigma) is charged.
    Catches the sends hidden under 1F1B too."""
    d = ParallelDims(tp=8, pp=2, dp=4)
    one_f_one_b = _time(JOB, d, v=1, zero=1, micro_batch=1)["exposed_pp"]
    interleaved = _time(JOB, d, v=2, zero=1, micro_batch=1)["exposed_pp"]
    assert one_f_one_b > 10 * interleaved > 0


def test_the_experts_overlap_is_credited_only_where_megatron_core_runs_it_and_with_its_fill():
    """Megatron-Core's 1F1B all-to-all overlap (core_r0.14.0): refused with a plain 1F1B pipeline and
    with full recomputation; without a pipeline one micro-batch in m runs alone (n_g = m), interleaved
    rank 0's warm-up of (p - 1) 2 + (v - 1) p + 1 of its v m chunks does (n_g = v m / W). Catches the
    overlap credited everywhere, and a fill of 1/m under interleaving."""
    from labs.formulas.planning import grid, software, timing
    job = dataclasses.replace(JOB, software=JOB.software.with_(ep_overlap=True))
    sched = software.SCHEDULES.index

    def cand(pp, v, m, s, rc="none"):
        return grid.Candidate.of(tp=1, pp=pp, cp=1, ep=8, dp=64 // pp, dpr=1, zero=1,
                                 rc=software.RECOMPUTE.index(rc), b=1, v=v, m=m, sched=sched(s), offload=0,
                                 reshard=0, sp=0, stage=0)
    assert timing.ep_overlap_chunks(job, cand(2, 1, 32, "1f1b")) is None
    assert timing.ep_overlap_chunks(job, cand(1, 1, 32, "1f1b", rc="full")) is None
    assert timing.ep_overlap_chunks(job, cand(1, 1, 32, "1f1b")) == 32
    assert timing.ep_overlap_chunks(job, cand(4, 8, 256, "interleaved")) == pytest.approx(8 * 256 / 35)
    assert timing.ep_overlap_chunks(JOB, cand(1, 1, 32, "1f1b")) is None     # the default stack: off


def test_a_rank_counts_other_degree_tuples_not_faster_settings_of_its_own():
    """rank_of: 1 + the other degree tuples estimated faster. A row behind its own tuple's faster
    settings (the planner's row for it) still ranks ahead of every slower tuple; counting its own
    tuple (the named mistake) would put it one place lower."""
    from labs.dims import ParallelDims
    from labs.formulas.planning import planner, shapes
    job = planner.Job(shapes.LLAMA2_70B, shapes.DGX_H100, 64, 4 * 2**20)
    mine, other, slow = ParallelDims(tp=8, dp=8), ParallelDims(tp=4, pp=2, dp=8), ParallelDims(tp=8, pp=8)
    ranked = [{"dims": mine, "time": {"step": 1.0}}, {"dims": other, "time": {"step": 1.5}},
              {"dims": slow, "time": {"step": 3.0}}]
    row = {"dims": mine, "time": {"step": 2.0}, "memory": {"weights": 1}, "fits": True}
    assert planner.rank_of({"job": job, "ranked": ranked}, row) == 2       # behind `other` only
    row["time"]["step"] = 1.2
    assert planner.rank_of({"job": job, "ranked": ranked}, row) == 1


def test_zero2s_per_micro_batch_charge_is_for_the_earlier_micro_batches_only():
    """ZeRO-2's reduce-scatters of the m - 1 earlier micro-batches run under later ones (charged at
    sigma); the last one's is the tail ZeRO-1 pays too. So with one micro-batch per replica the two
    stages cost the same. Catches m (not m - 1) micro-batches charged."""
    job = planner.Job(shapes.LLAMA2_70B, shapes.DGX_H100, 64, 8 * 4096)   # one sequence per replica
    d = ParallelDims(tp=8, dp=8)
    z1, z2 = (planner.published(job, d, ETA, {"zero": z, "micro_batch": 1}) for z in (1, 2))
    assert z2["m"] == 1
    assert z2["time"]["dp"] == pytest.approx(z1["time"]["dp"], rel=1e-12)


def test_ring_attention_hides_all_but_one_block_of_its_exchange():
    """Context parallelism's K/V exchange runs in cp steps beside attention on the block in hand:
    overlapped, it leaves one block's share (1/cp) and sigma's slowdown exposed, under half of the
    exposed time without the overlap. Catches the exchange priced as one chunk (nothing hidden)."""
    job = dataclasses.replace(JOB, model=dataclasses.replace(JOB.model, seq=8192))
    d = ParallelDims(tp=8, cp=4, dp=2)
    on = _time(job, d, zero=1, micro_batch=1)["exposed_cp"]
    plain = dataclasses.replace(job, software=job.software.with_(cp_overlap=False))
    off = _time(plain, d, zero=1, micro_batch=1)["exposed_cp"]
    assert 0 < on < 0.5 * off
