"""The published runs agree with themselves: degrees multiply to the GPUs, batches split, and each printed
pair (time and MFU, tokens/s and TFLOP/s, TFLOP/s and days) is reproduced by the FLOP count the row names.
A typo in a typed number breaks one of these."""
import pytest

from labs.planning import published_counts as c, published_runs as p, published_tables as t

RUNS = p.all_runs()


def test_the_degrees_multiply_to_the_gpus_and_the_batch_splits_over_dp_and_micro_batches():
    for r in RUNS:
        d = r.degrees
        if r.gpus:
            assert d["tp"] * d["pp"] * d["cp"] * d["dp"] == r.gpus, r.name
        if r.global_batch and r.micro_batch and d["dp"]:
            assert r.global_batch % (d["dp"] * r.micro_batch) == 0, r.name


def test_printed_degree_columns_agree_with_the_gpus():
    for size, a, h, L, tp, pp, dp, gpus, *_ in t.MEGATRON_H100_2024:
        assert tp * pp * dp == gpus, size
    for name, gpus, prec, gbs, b, seq, fsdp, tp, pp, cp, vp, ep, ga, tps, tf in t.NEMO_25_11_H100:
        assert gbs == ga * b * gpus // (tp * pp * cp), name          # GA = GBS / (MBS x DP)
    for disp, tp, cp, ep, pp, edp, etp, vpp, dp, fsdp, b, ga, *_ in t.MOE_ZOO_QWEN3_235B_H100:
        assert tp * cp * pp * dp == 256 and ep * edp * etp * pp == 256, (tp, pp, ep)
        assert 2048 == ga * b * dp, (tp, pp, ep)


def test_megatron_h100_mfu_and_aggregate_follow_from_the_tflops():
    for size, a, h, L, tp, pp, dp, gpus, batch, tf, mfu, agg in t.MEGATRON_H100_2024:
        assert abs(100 * tf * 1e12 / c.H100_PEAK - mfu) <= 0.51, size      # MFU printed to whole percents
        assert abs(tf * gpus / 1000 - agg) <= 0.05, size


def test_korthikanti_iteration_times_give_the_printed_mfu_hfu_and_speedup():
    for size, a, h, L, tp, pp, gpus, gbs, b, v, t_full, t_sel, inc, mfu, hfu in t.KORTHIKANTI_2022:
        m = c.gpt(size, L, h, a, 51_200)
        per_gpu = gbs * 2048 / t_sel / gpus / c.A100_PEAK
        assert abs(100 * per_gpu * c.korthikanti_eq7(m, 2048) - mfu) <= 0.2, size   # times printed to 0.01 s
        assert abs(100 * per_gpu * c.korthikanti_eq7(m, 2048, hardware=True) - hfu) <= 0.2, size
        assert abs(100 * (t_full / t_sel - 1) - inc) <= 0.15, size
    gpus, gbs, sec, mfu = t.KORTHIKANTI_530B_DP8
    m = c.gpt("530B", 105, 20480, 128, 51_200)
    assert abs(100 * gbs * 2048 / sec / gpus * c.korthikanti_eq7(m, 2048) / c.A100_PEAK - mfu) <= 0.1


def test_narayanan_table2_days_follow_from_the_tflops_by_eq3():
    m = {174.6: c.gpt("", 96, 12288, 96, 51_200), 529.6: c.gpt("", 105, 20480, 128, 51_200)}
    for scheme, size, mp, batch, gpus, b, tf, days in t.NARAYANAN_TABLE2:
        d = 300e9 * c.narayanan_eq3(m[size], 2048) / (gpus * tf * 1e12) / 86400
        assert abs(d - days) <= d * 0.5 / tf + 0.5, (scheme, size, gpus)   # TFLOP/s and days printed whole


def test_bloom_log_line_is_eq3_with_recomputation():
    it, sec, gbs, sps, tf = t.BLOOM_LOG
    assert abs(gbs / sec - sps) <= 0.001
    per_gpu = gbs * 2048 / sec / 384
    assert abs(c.tflops(per_gpu, c.narayanan_eq3(c.model("bloom"), 2048)) - tf) <= 0.05


def test_megascale_tokens_and_mfu_follow_from_the_iteration_time():
    m = c.gpt("175B", 96, 12288, 128, 64_000)
    mismatched = {}
    for method, batch, gpus, sec, tok, mfu, agg in t.MEGASCALE_TABLE2:
        assert abs(batch * 2048 / sec / tok - 1) <= 0.005, (method, gpus)
        if method == "Megatron-LM":   # MegaScale's own rows change the model (sliding-window attention)
            assert abs(100 * tok / gpus * c.korthikanti_eq7(m, 2048) / c.A100_PEAK - mfu) <= 0.2, gpus
        if abs(mfu / 100 * 312 * gpus / 1000 - agg) > 0.15:
            mismatched[method, gpus] = agg
    assert mismatched == t.MEGASCALE_AGGREGATE_MISMATCH


def test_torchtitan_bf16_8b_rows_span_the_printed_mfu_range_and_async_speedups_round_to_the_printed():
    bf16 = [round(100 * r.tflops * 1e12 / c.H100_PEAK) for r in p.torchtitan_runs()
            if r.model.name.endswith("8B") and r.precision == "bf16" and r.gpus in (8, 128)]
    assert (min(bf16), max(bf16)) == t.TORCHTITAN_2024_12_MFU_RANGE
    for size, gpus, fsdp, tp, local, ac, quant, vanilla, async_, speedup in t.TORCHTITAN_ASYNC_TP_2025_06:
        assert round(async_ / vanilla, 2) == speedup, (size, quant)


def test_nemo_tokens_times_the_palm_count_give_the_printed_tflops():
    for r in p.nemo_runs():
        if r.model.experts:
            # MoE rows: Megatron-Bridge's MoE count is not PaLM's (it counts the router and
            # shared experts)
            continue
        causal = r.name.startswith("NeMo 25.11")   # Megatron-Bridge halves the causal attention term
        assert abs(c.tflops(r.tokens_per_gpu_s, c.palm(r.model, r.seq, causal)) / r.tflops
                   - 1) <= 0.005, r.name


def test_moe_zoo_rows_of_one_batch_imply_one_flop_count_per_step():
    work = [tf * sec for *_, sec, tf, note in t.MOE_ZOO_QWEN3_235B_H100]   # TFLOP per GPU per step
    assert max(work) / min(work) - 1 <= 0.01   # TF printed whole, seconds to 0.1


def test_nemotron4_15b_iteration_times_give_the_printed_mfu():
    m = c.model("nemotron4-15b")
    for dp, gpus, sec, mfu, batch, tokens, days in t.NEMOTRON4_15B_TABLE2:
        got = 100 * c.tflops(batch * 4096 / sec / gpus, c.palm(m, 4096)) * 1e12 / c.H100_PEAK
        assert abs(got - mfu) <= mfu * 0.005 / sec + 0.05, gpus      # seconds printed to 0.01
        assert dp * 8 == gpus
        assert abs(tokens * 1e9 * sec / (batch * 4096) / 86400 - days) <= 0.05 + days * 0.005 / sec, gpus


@pytest.mark.parametrize("key, billions", [("bloom", 176), ("opt-175b", 175), ("nemotron4-15b", 15.6),
                                           ("nemotron-340b", 341), ("deepseek-v2", 236), ("llama3-405b",
                                                                                          405.9),
                                           ("qwen3-235b", 235), ("qwen3-30b", 30.5)])
def test_model_shapes_give_their_published_parameter_counts(key, billions):
    """BLOOM's README '176B', OPT Table 1, Nemotron-4 15B §2 (12.5B + 3.2B), Nemotron-4 340B, DeepSeek-V2
    §3.1.2 (236B, 21B active), Llama 3.1 405B (torchtitan's ModelArgs), Qwen3's names (235B-A22B, 30B-A3B:
    total and active parameters): the heads 128 wide on h = 4,096 (64 x 128 = 8,192) are
    what makes 235B; h / a would give less."""
    shape = c.model(key)
    assert abs(shape.params() / 1e9 / billions - 1) <= 0.01, shape.params()
    active = {"deepseek-v2": 21e9, "qwen3-235b": 22e9, "qwen3-30b": 3.3e9}
    if key in active:
        assert abs(shape.active_params() / active[key] - 1) <= 0.03


def test_table_models_fit_their_size_labels_and_llama3_widths_follow_torchtitans_rule():
    for size, a, h, L, *_ in t.MEGATRON_H100_2024:   # untied: 12 L h^2 + 2 V h
        params = c.gpt(size, L, h, a, 131_072, 4096, tied=False).params()
        label = float(size[:-1])
        assert abs(params / 1e9 - label) <= max(0.06, 0.02 * label), size   # tied would miss by 2 V h
    for size in (174.6, 529.6):   # Narayanan eq. 2, printed to 0.1B
        m = c.gpt("", 96, 12288, 96, 51_200) if size < 200 else c.gpt("", 105, 20480, 128, 51_200)
        assert round(m.params() / 1e9, 1) == size
    for key, dim, mult, multiple in (("llama3-8b", 4096, 1.3, 1024), ("llama3-70b", 8192, 1.3, 4096),
                                     ("llama3-405b", 16384, 1.2, 4096)):
        width = int(mult * int(2 * 4 * dim / 3))   # torchtitan models/llama/model.py FeedForward at 9dec370
        assert c.model(key).ffn == multiple * -(-width // multiple), key
