"""Chapter 14's planner model: bad input in one sentence, the memory and time terms against their
sources, one implementation for one layout and for thousands, and every published layout of the
checked set timed and fitted (the rankings are checked by the notebook, which plans every job)."""
import dataclasses
import json
import re

import pytest
import torch

from labs.dims import ParallelDims
from labs.memory_budget import activations
from labs.formulas import links
from labs.formulas.planning import (calibrated, kernels, memory, offload, planner, search, shapes, software,
                                     timing)
from labs.formulas import hf_config
from labs.planning import checked, eager_traffic, notes, published_runs, published_tables
from labs.planning import planner as command

L70 = shapes.LLAMA2_70B
JOB = planner.Job(L70, shapes.DGX_H100, 64, 4 * 2 ** 20)


@pytest.mark.parametrize("change, sentence", [
    (dict(batch_tokens=-4096), "batch_tokens must be a positive whole number, got -4096"),
    (dict(batch_tokens=0), "batch_tokens must be a positive whole number, got 0"),
    (dict(gpus=0), "gpus must be a positive whole number, got 0"),
    (dict(batch_tokens=4097), "is not a whole number of 4,096-token sequences"),
    (dict(precision="fp4"), "precision must be one of bf16, fp8"),
    (dict(cluster=shapes.SELENE, precision="fp8"), "needs FP8 tensor cores"),
])
def test_a_bad_job_is_one_sentence_before_anything_is_planned(change, sentence):
    with pytest.raises(ValueError, match=sentence):
        planner.plan(dataclasses.replace(JOB, **change), 0.5)


@pytest.mark.parametrize("eta", [0, -0.3, 1.5, float("nan"), True])
def test_eta_outside_its_range_is_named(eta):
    with pytest.raises(ValueError, match="eta must be a fraction of the peak above 0 and at most 1"):
        planner.plan(JOB, eta)


@pytest.mark.parametrize("fixed, sentence", [
    ({"v": 12}, r"v = 12 model chunks per stage is outside 1..10: pp = 8 stages of 80 layers"),
    ({"v": 2, "micro_batch": 32}, r"interleaved 1F1B with v = 2 needs the m = 4 micro-batches"),
    ({"micro_batch": 3}, r"b = 3 sequences per micro-batch does not divide the 128 sequences"),
    ({"zero": 5}, r"zero = 5 is not one any current stack offers"),
    ({"recompute": "sometimes"}, r"recompute = 'sometimes' is not one"),
])
def test_a_stated_setting_outside_its_range_is_named(fixed, sentence):
    # before: "no micro-batch size, schedule and ZeRO stage applies", whatever the reason
    with pytest.raises(ValueError, match=sentence):
        planner.published(JOB, ParallelDims(tp=1, pp=8, dp=8), 0.5, fixed)


def test_the_command_line_refuses_zero_and_negative_numbers(capsys):
    for argv, said in ((["--eta", "0"], "expected a positive finite number, got 0"),
                       (["--eta", "2"], "expected at most 1.0, got 2")):
        with pytest.raises(SystemExit):
            command.main(argv)
        assert said in capsys.readouterr().err
    # what the form reads (the batch, the sequence) it refuses in the form's own sentence, before any work
    for argv, said in ((["--batch-tokens", "0"], "global batch (tokens) must be at least 1, got 0."),
                       (["--batch-tokens", "-5"], "global batch (tokens) must be at least 1, got -5."),
                       (["--seq", "0"], "sequence length s must be at least 1, got 0.")):
        with pytest.raises(ValueError, match=re.escape(said)):
            command.main(argv)


def test_the_command_line_plans_a_model_from_its_config_json(tmp_path, capsys):
    """Qwen3-30B-A3B's config.json (its Hugging Face fields) gives the checked set's shape, and the command
    plans it; a config without a field the shape needs is one sentence naming the field."""
    cfg = {"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
           "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
           "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}
    shape = hf_config.shape_from_config(cfg, 4096, "Qwen3-30B-A3B")
    assert shape == published_tables.MODEL_SHAPES["qwen3-30b"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    command.main(["--config", str(path), "--world-size", "64", "--batch-tokens", "2097152", "--top", "3"])
    out = capsys.readouterr().out
    assert "layouts fit" in out and "HSDP" not in out.splitlines()[0]
    del cfg["hidden_size"]
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json has no 'hidden_size'"):
        command.main(["--config", str(path)])


def test_one_layout_and_a_thousand_are_priced_by_the_same_formulas():
    # the search adds memoized pieces and times only the candidates that fit; each candidate priced alone and
    # in full (`search.price`) must give the same pick, the same seconds and bytes, and those bytes must be
    # memory.rank_memory's on the stage the row names: a piece keyed on the wrong settings would differ
    plans = [memory.Plan(ParallelDims(tp=t, pp=p, dp=64 // (t * p)), zero=z, recompute=r, micro_batch=b, v=v)
             for t, p, z, r, b, v in [(8, 1, 1, "none", 1, 1), (4, 4, 3, "full", 2, 2), (2, 8, 0, "selective",
                                                                                         1, 4),
                                      (8, 2, 2, "selective", 4, 1), (1, 8, 1, "full", 1, 8)]]
    searches = [([pl.dims for pl in plans], {})] + [([pl.dims], {"zero": pl.zero, "recompute": pl.recompute,
                                                                  "micro_batch": pl.micro_batch, "v": pl.v})
                                                     for pl in plans]
    for layouts, fixed in searches:
        for d, row in zip(layouts, search.best_per_layout(JOB, 0.5, layouts, fixed, closest=True)):
            priced = [search.price(JOB, 0.5, c) for c in search.candidates(JOB, d, fixed)]
            fitting = [(p[3]["step"], i) for i, p in enumerate(priced) if p[1]]
            k = min(fitting)[1] if fitting else min((memory.total(p[0]), i) for i, p in enumerate(priced))[1]
            assert ("reason" in row) == (not fitting)
            assert row["time"] == priced[k][3] and tuple(row["memory"].values()) == priced[k][0]
            assert row["memory"] == memory.rank_memory(L70, row["plan"], "mixed", "fused", row["m"],
                                                       row["memory_stage"])


def test_the_activation_terms_the_issue_named():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    # full recomputation under sequence parallelism keeps the input's s/t rows (chapter 6 measures 2sbh/t)
    assert activations.gpt3_activation_bytes_per_layer(s, b, h, a, t, sp=True,
                                                       recompute="full") == 2 * s * b * h / t
    assert activations.gpt3_activation_bytes_per_layer(s, b, h, a, t, sp=False,
                                                       recompute="full") == 2 * s * b * h
    # a fused attention kernel keeps no s x s term: the second difference in s is 0 with it, 2 * 5ab/t without
    for attention, second in (("flash", 0), ("materialized", 2 * 5 * a * b / t)):
        f = [activations.gpt3_activation_bytes_per_layer(x, b, h, a, t, sp=True, attention=attention)
             for x in (1024, 2048, 3072)]
        assert (f[2] - 2 * f[1] + f[0]) / 1024 ** 2 == pytest.approx(second)
    # Qwen3's heads are 128 wide on h = 4,096: q and the attention output are a d = 8,192 wide
    q = activations.llama_activation_terms(16, 1, 4096, 64, 4, 1536, head_dim=128)["q"]
    assert q == 2 * 16 * 64 * 128


def test_nccl_alpha_from_its_tuning_constants():
    us = 1e-6
    # ring all-reduce on one NVLink node of 8: base 8.4 us + 2(n - 1) steps of 3.4 us (Simple protocol)
    assert links.alpha("all_reduce", 8, 1) == pytest.approx((8.4 + 14 * 3.4) * us)
    # across 16 nodes of 8, NCCL's tree beats the ring's 2 x 127 steps: base + 2 (7 x 4.0 + 4 x 14) us
    assert links.alpha("all_reduce", 128, 16) == pytest.approx((8.4 + 2 * (7 * 4.0 + 4 * 14)) * us)
    assert links.alpha("all_gather", 128, 16) == pytest.approx((8.4 + 112 * 3.4 + 15 * 14) * us)
    # 12 nodes: NCCL's log2i rounds down (tuning.cc), 3 network steps, not 4; a ceil fails here
    assert links.alpha("all_reduce", 96, 12) == pytest.approx((8.4 + 2 * (7 * 4.0 + 3 * 14)) * us)
    assert links.alpha("send", 2, 1) == 0.0 or links.alpha("send", 2, 2) > links.alpha("send", 2, 1)


@pytest.mark.parametrize("degrees, g", [(dict(tp=8, pp=2, dp=9), 72), (dict(cp=3, dp=4), 4),
                                        (dict(tp=2, pp=3, dp=4), 8), (dict(tp=8, pp=16, dp=128), 8),
                                        (dict(tp=2, cp=4, dp=4), 8), (dict(tp=4, ep=4, pp=2, dp=8), 8)])
def test_nodes_per_group_follow_chapter_11s_rule(degrees, g):
    d = ParallelDims(**degrees)
    for axis in ("tp", "cp", "ep", "pp", ("dp", "cp")):
        assert links.group_nodes(d, axis, g) == max(d.group_nodes(axis, g)), axis


def test_an_overlap_hides_only_what_its_compute_covers():
    assert timing.exposed(3.0, 10.0, 8) == pytest.approx(3 / 8)        # the pipeline's fill
    assert timing.exposed(10.0, 4.0, 2) == pytest.approx(6 + 2)         # what compute cannot cover
    job = planner.Job(L70, shapes.DGX_H100, 64, 4 * 2 ** 20, software.MEGATRON_CORE)
    plan, fixed = ParallelDims(tp=8, dp=8), {"zero": 1, "recompute": "none", "micro_batch": 1}
    on = planner.published(job, plan, 0.5, fixed)["time"]
    off = planner.published(dataclasses.replace(job, software=job.software.with_(tp_overlap=False)), plan,
                            0.5,
                            fixed)["time"]
    assert on["compute"] == off["compute"] and 0 < on["exposed_tp"] < off["exposed_tp"]
    assert off["step"] - on["step"] == pytest.approx(off["exposed_tp"] - on["exposed_tp"])


def test_eager_elementwise_traffic_is_counted_not_assumed():
    """The planner's record of the eager traffic is the lab's count (integers of bytes: exact), on the torch
    it was counted with; another torch may dispatch other ops, and the record then needs counting anew."""
    counted = eager_traffic.count()
    if torch.__version__.startswith(kernels.EAGER_TRAFFIC_TORCH + "."):
        assert counted == kernels.EAGER_TRAFFIC, f"record the new count in kernels.EAGER_TRAFFIC: {counted}"
    assert counted[0] / counted[1] > kernels.FUSED_PASSES            # eager ops move more than a fused stack
    assert kernels.eager_traffic_ratio() == kernels.EAGER_TRAFFIC[0] / kernels.EAGER_TRAFFIC[1]


def test_offloaded_optimizer_state_lives_on_the_host():
    rec = [r for r in notes.recipes() if "3090" in r.name][0]
    out = notes.evaluate_recipe(rec)
    mem = out["row"]["memory"]
    assert mem["optimizer"] == 0 and mem["gradients"] == 0 and out["fits"]
    params = rec.job.model.params()
    assert out["host_gib"] * 2 ** 30 == pytest.approx(offload.HOST_BYTES * params, rel=0.01)


@pytest.fixture(scope="module")
def published():
    cal = checked.calibration()
    return {c.name: (c, planner.published(c.job, c.published, checked.eta_for(c, cal), c.fixed))
            for c in checked.all_checked()}


def test_every_published_layout_fits(published):
    # Llama 3's FSDP shards gradients and optimizer state, not the weights (ZeRO-2's memory, §3.3.2): its 8K
    # rows fit. The ModelZoo's CP 8 row folds its 8 expert-parallel ranks over tp x cp (DP is 1): it fits
    # only as Megatron-Core holds it, whole experts on a folded grid (`ParallelDims.fold_ep`)
    refused = sorted(name for name, (c, row) in published.items() if not row["fits"])
    assert refused == []


def test_published_expert_degrees_are_taken_as_printed():
    # no EP is cut down to fit DP (an earlier version clamped EP 32 to DP 16): rows whose EP exceeds DP are
    # folded, and the CP 8 row's experts sit on runs of 8 consecutive ranks inside a node
    runs = {r.name: r for r in published_runs.all_runs()}
    cases = {c.name: c for c in checked.all_checked() if c.name in runs}
    assert all(c.published.ep == runs[name].degrees["ep"] for name, c in cases.items())
    folded = sorted(n for n, c in cases.items() if c.published.ep > c.published.dp)
    assert len(folded) == 7 and all(cases[n].published.fold_ep for n in folded)
    long = cases["ModelZoo Qwen3-235B s 131072 CP 8"].published
    assert long.groups("ep")[0] == list(range(8)) and max(long.group_nodes("ep", 8)) == 1


def test_calibration_rows_reproduce_and_predictions_stay_close(published):
    errors = {name: c.per_token() * c.job.batch_tokens / row["time"]["step"] / c.job.gpus / 1e12 / c.tflops
              - 1
              for name, (c, row) in published.items()}
    for eta, name in checked.calibration().values():
        assert abs(errors[name]) < 1e-6, name                      # bisection to 1e-9 in eta
    fitted = {name for _, name in checked.calibration().values()}
    predicted = [e for name, e in errors.items() if name not in fitted]
    # the page's figure is over the predictions alone: the fitted rows' zero errors do not count
    assert len(errors) == 112 and len(predicted) == 107
    assert sum(abs(e) <= 0.15 for e in predicted) >= 91       # the page's 91 of 107 (85 %)


def test_eager_cross_entropy_backward_peaks_at_12_sbv():
    # the torchtitan tail (bf16 head, F.cross_entropy on an fp32 copy, logits freed before backward),
    # counted: a formula that forgot the gradient of the log-softmax (8 sbV) or kept the logits (14) fails
    import torch
    import torch.nn.functional as F
    from labs.measure import memory as measured
    from labs.memory_budget import logits
    s, b, h, V = 64, 2, 32, 4096
    head = torch.nn.Linear(h, V, bias=False).to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, V, (b * s,))
    with measured.PeakMemory(head, x, y) as mem:
        pred = head(x)
        loss = F.cross_entropy(pred.flatten(0, 1).float(), y)
        forward = mem.peak_net
        del pred
        start = mem.net - 4 * s * b * V        # the tail's fp32 log-softmax is what backward starts with
        mem.peak_net = mem.net
        loss.backward()
    assert forward - logits.tail_forward_peak_bytes(s, b, V, 2, target_copy=False) < 64
    assert abs(mem.peak_net - start - logits.tail_backward_peak_bytes(s, b, V)) < 64


def test_folded_experts_are_whole_and_shard_over_their_own_group():
    # ETP = 1: a rank holds experts / ep whole experts (tp times the split count), and the ranks holding the
    # same experts are tp x cp x dp / ep, over which ZeRO shards their state
    m = published_runs.model("qwen3-235b")
    split = memory.rank_params(m, memory.Plan(ParallelDims(tp=4, pp=8, dp=8, ep=8)), 0)
    folded = memory.rank_params(m, memory.Plan(ParallelDims(tp=4, pp=8, dp=8, ep=8, fold_ep=True)), 0)
    assert folded["dense"] == split["dense"] and folded["expert"] == 4 * split["expert"]
    state = memory.state_terms(m, 4, 8, 8, 1, 0, 1, 8, "mixed", False, 1)     # ZeRO-1 over dp cp = 8
    per_param = memory.state_bytes(1, 4 * 8 // 8, "mixed")                    # experts: edp = 4
    dense_state = memory.state_bytes(1, 8, "mixed")
    assert state[2] == pytest.approx(folded["dense"] * dense_state["optimizer"]
                                     + folded["expert"] * per_param["optimizer"])


def test_the_recorded_calibration_is_the_fit():
    """The planner's recorded eta (`calibrated.ETA`) is `checked.calibration`'s fit: the same bisection on
    the same rows, the same operations in the same order, so equal to the last bit."""
    fitted = checked.calibration()
    assert fitted == calibrated.ETA, f"record the new fit in calibrated.ETA: {fitted}"
    with pytest.raises(ValueError, match="no published run calibrates RTX 3090 in bf16"):
        calibrated.eta("RTX 3090", "bf16")


# Each model's Hugging Face config.json, the fields the shape reads, as published on its model page
HF_CONFIGS = {
    "llama3-8b": {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                  "tie_word_embeddings": False},
    "qwen3-235b": {"num_hidden_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
                   "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
                   "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
                   "vocab_size": 151936, "decoder_sparse_step": 1, "mlp_only_layers": []},
    # MixtralConfig's defaults (huggingface/transformers ad467bd7), Mixtral-8x7B-v0.1's shape
    "mixtral-8x7b": {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "deepseek-v2": {"num_hidden_layers": 60, "hidden_size": 5120, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                    "n_routed_experts": 160, "n_shared_experts": 2, "num_experts_per_tok": 6,
                    "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "vocab_size": 102400},
}


@pytest.mark.parametrize("key", sorted(HF_CONFIGS))
def test_a_config_json_gives_the_checked_sets_shape(key):
    want = published_tables.MODEL_SHAPES[key]
    assert hf_config.shape_from_config(HF_CONFIGS[key], want.seq, want.name) == want


def test_a_config_the_shape_cannot_take_is_one_sentence():
    moe = dict(HF_CONFIGS["qwen3-235b"], num_experts_per_tok=129)
    with pytest.raises(ValueError, match=r"top-k must be 1\.\.128 \(got 129\)"):
        hf_config.shape_from_config(moe, 4096)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        hf_config.shape_from_config(dict(HF_CONFIGS["qwen3-235b"], mlp_only_layers=[0]), 4096)
