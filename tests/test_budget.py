"""Chapter 1: the calculator reproduces the papers; the lab measures what the calculator says."""
import json
import os
import subprocess
import sys

import pytest

from labs.memory_budget import budget, activations, zero_paper, recipes
from labs.launcher import launch
from labs import model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("stage,per_param", [(0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)])
def test_zero_stages_shard_the_16_bytes(stage, per_param):
    assert budget.state_bytes_per_param(stage, dp=8)["total"] == pytest.approx(per_param)


@pytest.mark.parametrize("column", ["7.5B", "128B", "1T"])
def test_every_column_of_zero_table1_is_reproduced(column):
    r = zero_paper.zero_table1_check()[column]
    assert r["matches"] == {1: True, 2: True, 3: True}, r
    assert r["baseline_gb"] == 16 * zero_paper.ZERO_PAPER_COLUMNS[column]["psi"] / 1e9  # the DP = 1 row
    # the old single-column check still reads the 7.5B column
    if column == "7.5B":
        table = zero_paper.zero_table1()
        assert all(zero_paper.matches_paper(table[st], zero_paper.ZERO_PAPER_TABLE1[st])
                   for st in (0, 1, 2, 3))


def test_each_column_prints_by_its_own_rule():
    r = zero_paper.zero_table1_check()
    # 7.5B rounds (30.35 -> 30.4): truncating would print 30.3
    assert not any(zero_paper.matches_paper(r["7.5B"]["computed"][st], r["7.5B"]["published"][st], "truncate")
                   for st in (1, 2, 3))
    # 128B and 1T truncate (513.5 -> 513): rounding would print 514; their P_os+g+p rows are exact or
    # 15.625 -> 15.6, where the two rules agree
    for col in ("128B", "1T"):
        assert [zero_paper.matches_paper(r[col]["computed"][st], r[col]["published"][st], "round")
                for st in (1, 2, 3)] == [False, False, True]
    assert (zero_paper.zero_table1(128e9)[1][-1] == 513.5
            and zero_paper.ZERO_PAPER_COLUMNS["128B"][1][-1] == 513)
    with pytest.raises(ValueError, match="printing must be 'round' or 'truncate'"):
        zero_paper.matches_paper([1.0], [1], "nearest")


def test_a_wrong_formula_would_not_match_table1():
    twelve = [2 + 2 + 8 / dp for dp in zero_paper.ZERO_PAPER_TABLE1["dp"]]  # the notes' 12-byte ZeRO-1
    assert not zero_paper.matches_paper([x * 7.5 for x in twelve], zero_paper.ZERO_PAPER_TABLE1[1])
    assert not zero_paper.matches_paper([x * 128 for x in twelve], zero_paper.ZERO_PAPER_COLUMNS["128B"][1],
                                        "truncate")


def llama_count(layers, h, heads, kv_heads, ffn, vocab):
    """A Llama's parameters written out by hand, independent of `ModelShape.params`: per layer the
    q and o projections (h x h each), k and v (h x kv_heads*h/heads each), the SwiGLU's three
    h x ffn matrices and two RMSNorm weights; an embedding and an output head (V x h each, untied)
    and the final RMSNorm."""
    kv = kv_heads * h // heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    return layers * layer + 2 * vocab * h + h


def test_llama_parameter_counts_come_out_of_the_shapes():
    # Exact, against the count written out by hand (a left-out norm, 0.0004 billion for 13B, fails it);
    # and rounded, against the published sizes: Llama 2 7B = 6.74B, 13B = 13.0B, 70B = 69.0B;
    # Llama 3.1 405B = 405.9B.
    hand = {"7B": llama_count(32, 4096, 32, 32, 11008, 32000),
            "13B": llama_count(40, 5120, 40, 40, 13824, 32000),
            "70B": llama_count(80, 8192, 64, 8, 28672, 32000),
            "405B": llama_count(126, 16384, 128, 8, 53248, 128256)}
    assert {k: budget.MODELS[k].params() for k in hand} == hand
    got = {k: round(a.params() / 1e9, 2) for k, a in budget.MODELS.items()}
    assert got["7B"] == 6.74 and round(got["13B"], 1) == 13.0
    assert round(got["70B"], 1) == 69.0 and round(got["405B"], 1) == 405.9


def test_activation_formula_parallel_variants():
    s, b, h, a = 2048, 1, 12288, 96
    full = activations.activation_bytes_per_layer(s, b, h, a)
    assert full == s * b * h * (34 + 5 * a * s / h)
    assert (activations.activation_bytes_per_layer(s, b, h, a, tp=8) == s * b * h
            * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert activations.activation_bytes_per_layer(s, b, h, a, tp=8, sp=True) == pytest.approx(full / 8)
    assert (activations.activation_bytes_per_layer(s, b, h, a, tp=8, sp=True, recompute="selective") == s * b
            * h * 34 / 8)
    assert activations.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    assert (activations.activation_bytes_per_layer(s, b, h, a, dropout=False) == s * b * h
            * (32 + 2 * a * s / h))


@pytest.mark.parametrize("kwargs,message", [
    (dict(model="8B"), "unknown model '8B'"),
    (dict(world_size=12, tp=8), "not divisible by tp\\*pp = 8"),
    (dict(world_size=24, pp=3), "pp must divide the layers"),
    (dict(zero_stage=4), "zero_stage must be"),
    (dict(recompute="some"), "recompute must be"),
    (dict(recipe="int4"), "unknown recipe"),
    (dict(attention="paged"), "attention must be"),
])
def test_bad_configurations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        budget.budget(**kwargs)


def test_ddp_does_not_fit_7b_in_80gib():
    r = budget.budget("7B", world_size=8, zero_stage=0, seq=1, micro_batch=1)
    assert r["gib_per_device"]["parameters"] + r["gib_per_device"]["optimizer_state"] > 80
    assert not r["fits"]
    assert budget.budget("7B", world_size=8, zero_stage=3, recompute="full")["fits"]


def test_capacity_is_counted_in_gib():
    r = budget.budget("7B", world_size=8, zero_stage=1, attention="flash")
    total = r["bytes_per_device"]["total"]
    assert r["capacity_bytes"] == 80 * 2**30 and r["gpu_gib"] == 80
    assert r["gb_per_device"]["total"] * 1e9 == pytest.approx(total) == r["gib_per_device"]["total"] * 2**30
    # exactly at capacity fits, a byte less does not: a GB/GiB mix-up would flip one of these
    assert budget.budget("7B", 8, zero_stage=1, attention="flash", gpu_gib=total / 2**30)["fits"]
    assert not budget.budget("7B", 8, zero_stage=1, attention="flash", gpu_gib=(total - 1) / 2**30)["fits"]


def test_zero1_on_8_gpus_fits_7b_only_with_flash_attention_or_recomputation():
    rows = {(r["recompute"], r["attention"]): r for r in budget.fit_grid("7B", 8, zero_stage=1, seq=4096)}
    assert {k: r["fits"] for k, r in rows.items()} == {
        ("none", "materialized"): False, ("none", "flash"): True, ("selective", "materialized"): True,
        ("selective", "flash"): True, ("full", "materialized"): True, ("full", "flash"): True}
    # the state is the same in every row: 2 + 2 + 12/8 bytes per parameter, in GiB
    state = 5.5 * budget.MODELS["7B"].params() / 2**30
    assert all(r["state_gib"] == pytest.approx(state) for r in rows.values())


def test_llama_formula_has_the_terms_of_a_llama_block():
    s, b, h, a, kv, f = 4096, 1, 8192, 64, 8, 28672  # Llama 2 70B
    flash = activations.llama_activation_terms(s, b, h, a, kv, f, attention="flash")
    mat = activations.llama_activation_terms(s, b, h, a, kv, f, attention="materialized")
    sbh, sb = s * b * h, s * b
    assert sum(flash.values()) == sbh * (12 + 4 * kv / a) + 8 * s * b * f + sb * (8 + 4 * a)
    assert sum(mat.values()) == sbh * (16 + 2 * a * s / h) + 8 * s * b * f + 8 * sb
    # with sequence parallelism everything divides by tp (here tp = kv = 8: one KV head per rank)
    sp8 = activations.llama_activation_terms(s, b, h, a, kv, f, tp=8, sp=True, attention="flash")
    assert sum(sp8.values()) == pytest.approx(sum(flash.values()) / 8)
    # without it, the norms, their statistics and the two projection inputs stay whole: 8sbh + 8sb
    tp8 = sum(activations.llama_activation_terms(s, b, h, a, kv, f, tp=8, attention="flash").values())
    assert tp8 - sum(flash.values()) / 8 == pytest.approx((8 * sbh + 8 * sb) * 7 / 8)
    # tp = 16 > 8 KV heads: each rank keeps one whole KV head
    assert (activations.llama_activation_terms(s, b, h, a, kv, f, tp=16, attention="flash")["k_v"] == 2 * 2
            * sb * (h // a))
    assert activations.llama_activation_terms(s, b, h, a, kv, f, recompute="full") == {"layer_input": 2 * sbh}
    with pytest.raises(ValueError, match="attention must be 'materialized' or 'flash'"):
        activations.llama_activation_terms(s, b, h, a, kv, f, attention="paged")


@pytest.mark.parametrize("kv_heads,rope", [(2, True), (4, False), (1, True)])
def test_llama_block_saves_exactly_what_the_formula_says(kv_heads, rope):
    shapes = [(1, 8), (2, 5), (3, 16)]
    for attention in ("sdpa", "materialized"):
        cfg = model.LlamaConfig(n_kv_head=kv_heads, rope=rope, attention=attention)
        for mode in ("none", "selective", "full"):
            for row in activations.measure_llama_activations(cfg, shapes, mode):
                assert row["measured"] == row["formula"], (attention, mode, row)
                # on a CPU, SDPA runs its flash kernel; the materialized block runs no attention op
                assert row["kernels"] == (["_scaled_dot_product_flash_attention_for_cpu.default"]
                                          if attention == "sdpa" else [])


def test_fused_rmsnorm_keeps_its_input_and_one_fp32_statistic_per_token():
    got = activations.rmsnorm_saved_bytes(32)
    assert got["fused"] == 2 * 32 + 4


def test_the_lab_measures_what_the_calculator_says_on_three_ranks():
    results = launch.spawn(budget.measure, 3, ("mixed", "fp32", "mixed_fp32_accum"), timeout=120)
    for name in ("mixed", "fp32", "mixed_fp32_accum"):
        measured = [r["recipes"][name]["bytes_per_param"] for r in results]
        assert measured == [recipes.recipe(name).bytes_per_param()["total"]] * 3
        # data parallel: after the all-reduce every replica holds the same weights
        assert len({r["recipes"][name]["param_checksum"] for r in results}) == 1
    for row in results[0]["activations"]:
        assert row["measured"] == row["formula"] + row["layernorm_stats"]
    # gloo's wire at N = 3, where a ring differs from a direct exchange: every rank's bytes
    # summed equal gloo's ring model (its 2(N-1)M plus each message's preambles) exactly
    for name in ("mixed", "fp32", "mixed_fp32_accum"):
        wires = [r["recipes"][name]["allreduce_wire_bytes"] for r in results]
        assert None not in wires or sys.platform != "linux", name  # gloo's wire is readable
        if None not in wires:
            sizes = results[0]["recipes"][name]["allreduce_sizes"]
            assert sum(wires) == budget.gloo_wire_all_ranks(sizes, 3), name
    for name, rows in results[2]["llama_activations"].items():
        assert [r["measured"] for r in rows] == [r["formula"] for r in rows], name


def test_calculator_command_line_prints_json():
    out = subprocess.run([sys.executable, "-m", "labs.memory_budget.budget", "--model", "70B", "--world-size",
                          "64", "--tp", "8", "--zero-stage", "1", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert (r["dp"], r["tp"], r["zero_stage"]) == (8, 8, 1)
    assert r["gb_per_device"]["total"] == pytest.approx(sum(v for k, v in r["gb_per_device"].items()
                                                            if k != "total"))
    assert r["attention"] == "materialized" and r["capacity_bytes"] == 80 * 2**30


def test_calculator_command_line_refuses_a_bad_split():
    proc = subprocess.run([sys.executable, "-m", "labs.memory_budget.budget", "--world-size", "12", "--tp",
                           "8"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: world_size 12 is not divisible")


def test_lowest_zero_stage_is_the_first_that_leaves_the_headroom():
    """Chapter 3's quiz: at batch 8 ZeRO-1 fits 80 GiB with no margin, so 10 % headroom needs ZeRO-2;
    a model no stage can hold on 8 GPUs gives None."""
    kw = dict(seq=4096, micro_batch=8, recompute="full")
    assert budget.lowest_zero_stage("13B", 8, 0.0, **kw) == 1
    assert budget.lowest_zero_stage("13B", 8, 0.1, **kw) == 2
    assert budget.lowest_zero_stage("405B", 8, 0.0, **kw) is None


def test_fewest_gpus_for_the_notes_estimates():
    """The notes' "7B: 1-2 x A100 ... 405B: 64+" against the calculator: 7B under ZeRO-2 needs 2,
    405B's state alone under ZeRO-3 needs more than 64 GPUs; one fewer GPU never fits."""
    for name, stage in (("7B", 2), ("405B", 3)):
        n = budget.fewest_gpus(name, stage, activations=False)
        state = lambda k: budget.budget(name, k, zero_stage=stage)["bytes_per_device"]
        fits = lambda k: state(k)["total"] - state(k)["activations"] <= budget.GPU_GIB * budget.GIB
        assert fits(n) and not fits(n - 1), (name, n)
    assert budget.fewest_gpus("7B", 2, activations=False) == 2
    assert budget.fewest_gpus("405B", 3, activations=False) > 64


def test_the_nominal_parameter_count_is_named_though_it_is_inside_the_tolerance(capsys):
    """Exercise 1 with 13e9 for Llama-2 13B's real count is 0.12 % off, inside the 1 % tolerance: the
    checker tests the named mistake first and refuses it, while the right answer rounded passes."""
    right = budget.EXERCISES["1"]()
    assert not budget.check("1", 3.75 * 13e9 / 1e9)
    assert "the 13e9 parameters of the model's name" in capsys.readouterr().out
    assert budget.check("1", round(right, 1)) and budget.check("1", right)


def test_memory_over_two_steps_adds_up_to_the_peak_and_peaks_where_the_page_says():
    from labs.memory_budget import step_memory
    tl = step_memory.step_timeline(steps=2, batch_size=2, cfg=model.GPTConfig(n_layer=1))
    phase = dict(tl["phases"])
    assert tl["curve_peak_bytes"] == tl["peak_bytes"]
    assert {k: tl["end"][k] for k in ("weights", "gradients", "optimizer_state")} == {
        "weights": 2.0, "gradients": 2.0, "optimizer_state": 12.0}
    assert not any(tl["optimizer_state"][:phase["optimizer 1"]])
    assert phase["backward 2"] <= tl["peak_index"] < phase["optimizer 2"]


def test_where_the_step_peaks_depends_on_zero_grad_but_the_bound_holds():
    """With gradients freed between steps (torch.optim's default, set_to_none=True) and b = 1 the
    highest point is step 1's optimizer step, not step 2's backward: "the peak sits at the start of
    backward" is not a rule. What holds in every setting is 16 bytes of state plus the most that
    activations and temporaries take at once; freed gradients are still counted as gradients."""
    from labs.memory_budget import step_memory
    for b, to_none in ((2, False), (1, True), (2, True)):
        tl = step_memory.step_timeline(steps=2, batch_size=b, cfg=model.GPTConfig(n_layer=1),
                                       set_to_none=to_none)
        phase, i = dict(tl["phases"]), tl["peak_index"]
        assert tl["peak_bytes"] / tl["numel"] <= 16 + max(tl["other"]) / tl["numel"] + 1e-12
        if to_none:  # step 1's gradients are marked gradients until they are freed
            assert tl["gradients"][phase["optimizer 1"]] == tl["gradients"][-1]
            assert tl["gradients"][phase["backward 2"]] == 0
        if (b, to_none) == (1, True):
            assert phase["optimizer 1"] <= i < phase["forward 2"]


def test_torch_adam_keeps_no_master_copy_on_bf16_weights():
    """Measured, not built: torch.optim.Adam on bf16 weights keeps bf16 m and v and one fp32 step
    per parameter tensor (torch/optim/adam.py, _init_group): 2 + 2 + 4 bytes plus the steps, not 16."""
    r = recipes.weigh_torch_adam(cfg=model.GPTConfig(n_layer=1))
    assert r["held"]["optimizer_state"] == 4 * r["numel"] + 4 * r["tensors"]
    assert r["held"]["total"] < 16 * r["numel"]
    assert r["dtypes"] == ["exp_avg bfloat16", "exp_avg_sq bfloat16", "step float32"]
    assert r["by_key"] == {"exp_avg": 2 * r["numel"], "exp_avg_sq": 2 * r["numel"], "step": 4 * r["tensors"]}


def test_torch_adam_foreach_step_makes_a_temporary_the_size_of_all_of_v():
    """Measured: foreach Adam's torch._foreach_sqrt(exp_avg_sqs) holds a copy of every v at once;
    the per-tensor loop two of the tensor it updates plus the previous tensor's denom, exactly (a third
    temporary, or a denom freed early, moves it off the count); fused=True none."""
    cfg = model.GPTConfig(n_layer=1)
    t = {impl: recipes.torch_adam_step_temporaries(impl, cfg) for impl in ("for-loop", "foreach", "fused")}
    n, largest = t["foreach"]["numel"], t["foreach"]["largest"]
    assert t["foreach"]["temporaries"] == t["foreach"]["v_bytes"] == 4 * n
    assert t["for-loop"]["temporaries"] == t["for-loop"]["loop_count"]
    assert 2 * 4 * largest < t["for-loop"]["loop_count"] < 3 * 4 * largest
    assert t["fused"]["temporaries"] == 0
    with pytest.raises(ValueError, match="impl"):
        recipes.torch_adam_step_temporaries("sgd")


def test_activations_pass_the_state_where_the_bisection_says():
    from labs.memory_budget import step_memory
    for shape in step_memory.LLAMA3.values():
        for attention in ("flash", "materialized"):
            s = step_memory.crossover_seq(shape, attention)
            acts = lambda n: budget.model_activations(shape, n, 1, attention=attention)["total_bytes"]
            assert acts(s - 1) < 16 * shape.params() <= acts(s)


def test_llama_formula_per_term_scaling_on_a_second_shape():
    # at h = 32, a = 4, h_ff = 88 every sb term has one coefficient: the log-sum-exp's 4sba written
    # sbh/2, or the norms' 8sb written 2sba, would match there. At h = 48, a = 3, a_kv = 1,
    # h_ff = 128 they do not, and the measurement must still equal the formula.
    s, b = 16, 2
    for h, a in ((32, 4), (48, 3)):
        same = 4 * s * b * a == s * b * h // 2 and 8 * s * b == 2 * s * b * a
        assert same == (h == 32)
    for attention in ("sdpa", "materialized"):
        cfg = model.LlamaConfig(hidden=48, n_head=3, n_kv_head=1, ffn=128, attention=attention)
        for mode in ("none", "selective", "full"):
            for row in activations.measure_llama_activations(cfg, [(b, s)], mode):
                assert row["measured"] == row["formula"], (attention, mode, row)
