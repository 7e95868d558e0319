"""Chapter 9: recomputation policies keep the bytes and cost the FLOPs the formulas say, and leave the
gradients unchanged; gradient accumulation equals the full batch, clipping acts once on the sum,
offloading keeps only the input. no_sync under DDP and FSDP and recomputation under 1F1B are asserted
in the notebook at 2 ranks, where 1 - 1/N = 1/N and min(p - s, m) = m - s; here FSDP's extra gradient
memory and 1F1B's micro-batches in flight are checked at 3 ranks, where those pairs differ."""
import json

import pytest
import torch

from labs.data_parallel import loss_reduction
from labs.recompute import accumulation as acc, offload, pipeline_memory as pm, policies as rc

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def rows():
    return {"default": rc.compare(), "other": rc.compare(rc.config(layers=3, seq=32), batch=1, k=3)}


@pytest.mark.parametrize("shape", ["default", "other"])
def test_every_policy_measures_its_formula(rows, shape):
    for policy, r in rows[shape].items():
        assert r["activation_bytes"] == r["formula_bytes"], policy        # live storages, exact
        assert r["forward_flops"] == r["formula_flops"]["forward"], policy
        assert r["backward_flops"] == r["formula_flops"]["backward"], policy
        # a recomputation reruns the same CPU kernels on the same inputs in the same order: the
        # gradients are the same bits, so any difference at all would be a recomputation bug
        assert r["max_grad_diff_vs_none"] == 0.0, policy   # the same kernels rerun: bit for bit
    r = rows[shape]
    assert r["full"]["flops_ratio_vs_none"] == pytest.approx(4 / 3, abs=1e-12)   # one extra forward, not 2x
    assert r["every-k"]["flops"] == r["full"]["flops"]
    assert r["selective"]["flops"] < r["full"]["flops"]
    # Chen et al.: segments keep fewer inputs than full, and pay for it with a higher peak in backward
    assert r["every-k"]["activation_bytes"] < r["full"]["activation_bytes"]
    assert r["every-k"]["peak_bytes"] > r["full"]["peak_bytes"]


def test_a_policy_that_also_saves_the_softmax_is_caught(monkeypatch):
    """The plausible bug: the softmax kept, so the s x s scores stay; the measurement shows exactly them."""
    monkeypatch.setattr(rc, "SAVED_OPS", rc.SAVED_OPS | {torch.ops.aten._softmax.default})
    cfg, b = rc.config(), 2
    r = rc.measure("selective", cfg, b)
    assert r["activation_bytes"] - r["formula_bytes"] == cfg.n_layer * 2 * cfg.n_head * cfg.seq_len ** 2 * b


def test_save_all_recomputes_nothing_and_keeps_the_gradients():
    """The timing's control: the selective machinery with every output saved reruns no matmul
    in backward (the FLOPs of "none") and gives "none"'s gradients bit for bit."""
    from labs.measure import flops
    cfg, grads, counted = rc.config(), {}, {}
    for policy in ("none", "save-all"):
        blocks, x, run = rc._step(cfg, 2, policy, 2, torch.bfloat16)
        with flops.counting() as fc:
            run(x).sum().backward()
        counted[policy] = fc.get_total_flops()
        grads[policy] = [p.grad for b in blocks for p in b.parameters()] + [x.grad]
    assert counted["save-all"] == counted["none"]
    assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads["save-all"]))


def test_saved_tensor_hooks_do_not_see_the_policy_cache():
    """Why the lab reads live storages: saved-tensor hooks see the checkpoints' inputs and nothing of
    what the selective policy caches, so they would report "selective" as cheap as "full"."""
    from labs.measure import memory
    cfg = rc.config()
    blocks, x, run = rc._step(cfg, 2, "selective", 2, torch.bfloat16)
    with memory.saved_for_backward() as saved:
        run(x).sum()
    assert saved.bytes == rc.formula_bytes("full", cfg, 2) < rc.formula_bytes("selective", cfg, 2)


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="k=3 must divide the 4 layers"):
        rc.apply_policy([None] * 4, "every-k", 3)
    with pytest.raises(ValueError, match="policy must be one of"):
        rc.apply_policy([], "sometimes")


def test_cli_prints_the_contract_keys(capsys):
    rc.main(["--policy", "selective", "--layers", "2", "--json"])   # in process: no second torch import
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["activation_bytes"] == r["formula_bytes"] and r["flops"] > 0
    assert r["flops_ratio_vs_none"] == pytest.approx(r["formula_flops_ratio_vs_none"], abs=1e-12)
    with pytest.raises(ValueError, match="k=3 must divide the 4 layers"):   # before anything runs
        rc.main(["--policy", "every-k", "--k", "3"])


def test_the_at_scale_formulas_give_what_the_tiny_stack_counted(rows):
    """selective_at_scale's overheads, evaluated at the tiny shape, against the FLOPs counted there: an
    overhead formula that counted the attention products' backward again (Korthikanti et al.'s
    Appendix A, 3x) or forgot backward's factor 2 fails."""
    cfg = rc.config()
    tiny_g = rc.selective_at_scale(h=cfg.hidden, a=cfg.n_head, s=cfg.seq_len, dropout=False)
    r = rows["default"]
    assert tiny_g["selective_flops_added"] == pytest.approx(r["selective"]["flops_ratio_vs_none"] - 1,
                                                            abs=1e-12)
    assert tiny_g["full_flops_added"] == pytest.approx(r["full"]["flops_ratio_vs_none"] - 1, abs=1e-12)
    g = rc.selective_at_scale()
    assert round(g["korthikanti_flops_added"] * 100, 1) == 2.7          # their Appendix A gives their 2.7 %
    assert g["korthikanti_flops_added"] > 2.5 * g["selective_flops_added"]


def test_accumulation_of_unequal_micro_batches_equals_the_full_batch():
    r = acc.accumulation_vs_full_batch(accumulation=3)
    assert len(set(r["counts"][0])) > 1                     # unequal token counts per micro-batch
    assert r["right_err"] < loss_reduction.BOUND           # rounding only (see loss_reduction.BOUND)
    assert r["naive_err"] > loss_reduction.MARGIN          # the per-micro-batch mean is another objective


def test_clipping_once_after_unscaling_equals_the_full_batch_and_the_wrong_orders_do_not():
    r = acc.clipping(accumulation=2, batch=1)
    m, cf, s = r["modes"], r["max_norm"] / r["full_batch_norm"], r["scale"]
    assert m["once"]["relative_difference"] < 1e-4          # fp32 sums in another order
    # every micro-batch's own norm exceeds the threshold: each piece is clipped
    assert min(m["per micro-batch"]["norms_seen"]) > 1.5 * r["max_norm"]
    # clipped, near-orthogonal pieces of near-equal norms: sqrt(m) - 1, to 5 points; a branch that
    # never clips misses by (1 - c_f) / c_f = 300 % and fails here
    assert abs(m["per micro-batch"]["relative_difference"] - (2 ** 0.5 - 1)) < 0.05
    assert abs((1 - cf) / cf - (2 ** 0.5 - 1)) > 1
    assert m["before unscaling"]["relative_difference"] == pytest.approx(1 - 1 / s, abs=1e-3)
    assert m["before unscaling"]["norms_seen"][0] == pytest.approx(s * r["full_batch_norm"], rel=1e-3)


def test_offloading_keeps_only_the_input_and_moves_every_saved_tensor():
    cfg = rc.config(layers=2, seq=16)
    r = offload.compare(cfg, batch=1)
    o = r["rows"]
    assert all(v["grads_equal"] for v in o.values())                   # a copy there and back changes no bit
    assert o["none"]["kept_bytes"] == r["formula_bytes"]
    assert o["hand offload"]["kept_bytes"] == 2 * cfg.seq_len * 1 * cfg.hidden   # the bf16 input only
    # the hook's copies against the saved tensors read from the autograd graph's nodes: a pack
    # that skipped a tensor, copied one twice or moved a weight would not match
    assert o["hand offload"]["to_host_bytes"] == o["hand "
                                                   "offload"]["to_device_bytes"] == r["saved_tensor_bytes"]
    assert r["saved_tensor_bytes"] > o["none"]["kept_bytes"]    # a tensor saved by two ops moves twice
    assert o["hand offload"]["peak_bytes"] < o["none"]["peak_bytes"]
    assert o["torch save_on_cpu"]["kept_bytes"] == o["none"]["kept_bytes"]    # on a CPU, .cpu() moves nothing


def test_fsdp_without_sync_holds_the_unsharded_rest_of_the_gradients_at_three_ranks():
    """At N = 3 the gradients held beyond the synchronised run's shard are (1 - 1/N) = 2/3 of the full
    gradients (a little less: shards are padded), not 1/N; at N = 2 the two are equal."""
    fs = acc.fsdp_no_sync(world_size=3, accumulation=2, batch=1)
    full, n = fs["unsharded_grad_bytes"], 3
    for kind in ("hand", "fsdp2"):
        for rank in fs["ranks"]:
            quiet, loud = rank[f"{kind}, no sync until the last"], rank[f"{kind}, sync every micro-batch"]
            extra = quiet["held_after_micro_batch"][0] - loud["held_after_micro_batch"][0]
            assert abs(extra / full - (1 - 1 / n)) < 0.02, (kind, extra, full)
            assert quiet["held_after_micro_batch"][-1] == loud["held_after_micro_batch"][-1], kind
            assert quiet["max_param_diff_vs_one_process"] < 1e-6, kind


def test_1f1b_holds_min_p_minus_s_and_m_micro_batches_at_p3_m6():
    """At p = 3, m = 6 stage s holds min(p - s, m) = 3, 2, 1 micro-batches, where m - s would give 6, 5,
    4; the held peak is that count times one micro-batch's bytes, with and without recomputation."""
    pp = pm.run_policy(world_size=3, m=6, layers_per_stage=1, batch=1)
    for policy, stages in pp["policies"].items():
        assert [r["in_flight_peak"] for r in stages] == [3, 2, 1], policy
        for r in stages:
            assert r["held_peak_bytes"] == r["in_flight_peak"] * r["one_micro_batch_bytes"], policy
            assert r["max_abs_error_grad"] < 1e-5, policy
    assert all(f["one_micro_batch_bytes"] < n["one_micro_batch_bytes"]
               for f, n in zip(pp["policies"]["full"], pp["policies"]["none"]))


def test_bad_input_of_the_distributed_labs_is_one_sentence_before_any_process_starts():
    with pytest.raises(ValueError, match="cannot fill 3 stages"):
        pm.run_policy(world_size=3, m=2)
    with pytest.raises(ValueError, match="offloading runs in one process"):
        offload.main(["--world-size", "2"])


@pytest.fixture(scope="module")
def clipped():
    from labs.recompute import clip_norm
    return clip_norm.run(timeout=240)


@pytest.mark.numerics
def test_the_global_norm_counts_each_shard_once_and_equals_one_process(clipped):
    """Under FSDP + TP and PP + TP, Megatron's rule by hand and the library on DTensors (torchtitan's
    pipeline reduction added) both give one process's norm, and the clipped gradients equal one
    process's; counting the TP-replicated LayerNorms and biases on every tp rank, or stopping at a
    stage's own norm, misses by far more than the rounding bound."""
    from labs.recompute import clip_norm
    ref = clipped["reference"]
    assert ref > clip_norm.MAX_NORM                                   # clipping acted
    for name in ("fsdp_tp", "pp_tp"):
        r = clipped[name]
        for way in ("hand", "library"):
            assert abs(r[way] / ref - 1) < clip_norm.BOUND, (name, way, r[way], ref)
        assert r["max_grad_err"] < clip_norm.BOUND, name
        assert r["duplicates_counted"] / ref - 1 > 100 * clip_norm.BOUND, name
    assert 1 - clipped["pp_tp"]["stage_only"] / ref > 100 * clip_norm.BOUND


def test_the_clipping_lab_refuses_another_world_size():
    from labs.recompute import clip_norm
    with pytest.raises(ValueError, match="dp \\(or pp\\) = 2 by tp = 2"):
        clip_norm.main(["--world-size", "2"])
