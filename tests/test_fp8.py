"""Chapter 8: FP8 scaling granularity, the kernels tried, MXFP8, delayed scaling, limited-precision
accumulation, BF16 without a master copy, FP8 bytes through gloo's wire."""
import subprocess
import sys

import pytest
import torch

from labs.precision import fp8, fp8_wire, kernels, master_weights as mw, scaling

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics


def test_block_scaling_beats_per_tensor_on_outlier_channels():
    r = fp8.matmul_error()
    e, z = r["errors"], r["x_zero_fraction"]
    assert e["block"] < e["row"] < e["tensor"]
    assert z["block"] < z["tensor"] / 5  # per-tensor flushes the ordinary channels to zero


def test_every_kernel_that_runs_agrees_with_the_emulation_and_a_wrong_scale_is_caught():
    r = kernels.try_kernels(M=128, K=256, N=128)["kernels"]
    assert r["tensorwise"]["ran"], r["tensorwise"]     # every CPU build since 2.11 has this one
    for name, v in r.items():
        assert v["ran"] == (v["error"] is None) and (v["gap"] is None) != v["ran"], name
        # the same FP8 values multiplied; the bound is the device's (a GPU's accumulator is shorter)
        if v["ran"]:
            assert v["gap"] < v["gap_bound"], name
        elif "Invalid scaling configuration" in v["error"]:   # kept whole: the supported list follows
            assert "- For TensorWise scaling" in v["error"], v["error"]
    # the plausible bug: handing the kernel the *encoding* scales (448 / amax) instead of decoding ones
    x, w = fp8.activations(128, 256), torch.randn(128, 256) / 16
    a, b, sa, sb, kinds, ref = kernels._operands("tensorwise", x, w)
    wrong = kernels._call(a, b, 1 / sa, 1 / sb, kinds)
    assert ((wrong.double() - ref).norm() / ref.norm()).item() > 1e3 * kernels.GAP_BOUND


def test_the_order_holds_on_every_draw_and_the_summary_is_of_those_draws():
    r = fp8.matmul_error_seeds(seeds=range(3))   # the shapes the chapter draws
    for run in r["runs"]:
        e, z = run["errors"], run["x_zero_fraction"]
        assert e["block"] < e["row"] < e["tensor"]
        assert z["block"] < z["row"] < z["tensor"] and z["block"] < z["tensor"] / 5
    each = r["x_zero_fraction"]["tensor"]["each"]
    # three different draws (a summary of one draw repeated would have no spread)
    assert len(set(each)) == 3 and r["x_zero_fraction"]["tensor"]["median"] == sorted(each)[1]


def test_the_mx_scale_is_e8m0_read_from_finfo():
    from labs.precision import figures
    mx = figures.mx_scale()
    assert (mx["exponent_bits"], mx["mantissa_bits"], mx["block"]) == (8, 0, 32)
    assert (mx["max"], mx["smallest"]) == (2.0 ** 127, 2.0 ** -127)


def test_without_outliers_granularity_matters_little():
    r = fp8.matmul_error(outliers=0)
    assert r["errors"]["tensor"] < 1.2 * r["errors"]["block"]
    assert r["x_zero_fraction"]["tensor"] < 1e-3


def test_quantize_round_trip_and_bad_shapes():
    x = fp8.activations(128, 256)
    for g in fp8.GRANULARITIES:
        q, s = fp8.quantize(x, g)
        assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() == 448.0  # amax maps to max
    with pytest.raises(ValueError, match="divisible by 128"):
        fp8.quantize(torch.ones(100, 256), "128x128")
    with pytest.raises(ValueError, match="unknown granularity"):
        fp8.quantize(x, "column")


def test_short_accumulator_error_grows_with_k_and_promotion_bounds_it():
    r = fp8.accumulation(Ks=(128, 1024, 4096), rows=32)
    lim, pro = r["limited"], r["promoted"]
    assert lim[0] == pro[0]              # K = 128: one interval, nothing to promote
    assert lim[2] > 8 * lim[0]           # grows with K
    assert pro[2] < lim[2] / 10 and max(pro) == pro[0]   # promoted, it does not grow with K
    assert max(pro) < 2 ** -12


def test_round_to_bits():
    s = torch.tensor([1 + 2 ** -13, 1 + 2 ** -14, 3.0], dtype=torch.float64)
    assert fp8.round_to_bits(s, 14).tolist() == [1 + 2 ** -13, 1.0, 3.0]  # ties to even


@pytest.mark.parametrize("world_size", [3])
def test_fp8_allgather_wire_bytes_are_half_of_bf16s_plus_framing(world_size):
    r = fp8_wire.allgather_bytes(world_size, numel=1000, timeout=120)
    assert r["gloo_refuses_fp8"] and not r["wire_missing"]    # FP8 cannot be sent as FP8
    assert r["payload"] == {"bf16": 2000, "fp8": 1000, "scale": 4}
    # measured on every rank, equal to gloo's model of its ring all-gather for the payloads gathered;
    # a shard sent as fp32 (dequantised) or as bf16 would write 2 or 4 times the fp8 data bytes
    assert all(w == r["model"] for w in r["wire"])
    w = r["wire"][0]
    framing = r["model"]["fp8"] - (world_size - 1) * 1000
    assert w["bf16"] - framing == 2 * (w["fp8"] - framing) == 2 * (world_size - 1) * 1000


def test_mxfp8_scales_are_bytes_of_powers_of_two_and_the_spec_rule_saturates():
    x = fp8.activations(64, 256)
    for rounding in ("floor", "ceil"):
        q, scale, saturated = scaling.mx_quantize(x, rounding)
        assert (q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
                and scale.element_size() == 1)
        s = scale.float()
        assert torch.equal(s, torch.exp2(torch.log2(s).round()))   # E8M0 holds powers of two only
        amax = x.abs().reshape(64, 256 // 32, 32).amax(2)
        top = amax / s                                               # where each block's amax lands
        # the clamp's count, re-derived here: elements that land above 464 once scaled
        over = int((x.reshape(64, 256 // 32, 32).abs() / s.unsqueeze(2) > scaling.OVERFLOW).sum())
        assert saturated == over
        if rounding == "floor":   # the specification: floor(log2 amax) - 8 puts the top in [256, 512)
            assert bool(((top >= 256) & (top < 512)).all()) and saturated > 0
        else:                     # rounded up: the top in (224, 448], nothing saturates
            assert bool(((top > 224) & (top <= 448)).all()) and saturated == 0
    with pytest.raises(ValueError, match="divisible by 32"):
        scaling.mx_quantize(torch.ones(4, 48))
    r = scaling.blocks_vs_mx(M=128, K=256)["rows"]
    assert r["1x128, fp32 scale"]["scale_bytes_per_element"] == r["1x32 MX, "
                                                                  "E8M0 (round "
                                                                  "up)"]["scale_bytes_per_element"]
    assert r["1x32 MX, E8M0 (spec: floor)"]["error"] > r["1x32 MX, E8M0 (round up)"]["error"]
    assert r["1x32 MX, E8M0 (round up)"]["flushed"] < r["1x128, fp32 scale"]["flushed"]


def test_delayed_scaling_overflows_exactly_where_its_window_is_behind():
    r = scaling.drift(history=4, steps=24, spike_step=12)
    # a delayed scale that (wrongly) included the current amax would never overflow: steps must exist.
    # The count (elements scaled above 464) and the prediction (amax > top * 464 / 448) apply the same
    # threshold by construction: their agreement checks which amaxes set each step's scale
    assert r["saturating_steps"] and r["saturating_steps"] == r["saturating_steps_predicted"]
    assert set(r["saturating_steps"]) <= set(r["above_window_steps"])
    assert 12 in r["saturating_steps"] and r["steps"]["delayed"][12]["error"] > 0.5
    assert r["totals"]["current"]["saturated"] == 0


def test_a_late_scale_flushes_most_outlier_laden_activations():
    r = scaling.late_scale_flush(50, M=128, K=256)
    assert r["flushed_late"] > 0.5 * r["elements"] > 10 * r["flushed_right"]


def test_bf16_without_a_master_loses_updates_and_both_fixes_keep_them():
    r = mw.lost_updates(steps=100, lr=0.01, n=1024)
    assert r["rule_mismatches"] == 0                 # every loss is where half the spacing says
    d = r["distance_to_fp32"]
    assert d["nearest"] > 0.5 and d["stochastic"] < 0.15 and d["kahan"] < 0.05


def test_stochastic_rounding_is_unbiased_between_two_neighbours():
    x = torch.full((1 << 14,), 1 + 2 ** -9)         # a quarter of the way from 1 to 1 + 2^-7
    got = mw.round_stochastic(x, torch.Generator().manual_seed(0)).float()
    assert set(got.unique().tolist()) == {1.0, 1 + 2 ** -7}
    up = (got > 1).double().mean().item()
    assert abs(up - 0.25) < 4 * (0.25 * 0.75 / x.numel()) ** 0.5    # four binomial standard deviations


def _rounds_to_nearest(r, key):
    """Each row within half a bf16 ulp (2^-8 of the value) plus the FP32 sum's own bound g, and the
    mean over rows below 0.55 * 2^-8. Rounding to nearest leaves an absolute error spread over
    [0, ulp/2], a mean relative error of about 2^-9 * E[1/m] <= 2^-9 for a significand m in [1, 2)
    (2^-9 ln 2 for uniform m); chopping (round toward zero) spreads it over [0, ulp), about
    2^-8 ln 2 = 0.69 * 2^-8. Measured on these 64 rows: 0.37-0.41 * 2^-8 and 0.67-0.74 * 2^-8."""
    gamma = [(k - 1) * 2 ** -24 / (1 - (k - 1) * 2 ** -24) for k in r["K"]]
    rows_ok = all(e < 2 ** -8 * (1 + g) + g for g, row in zip(gamma, r["rows"][key]) for e in row)
    return rows_ok and all(m < 0.55 * 2 ** -8 for m in r[key])


def _chop_to_bf16(x):                                # the bug: round toward zero (drop the low 16 bits)
    return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def test_fp32_accumulation_of_bf16_products_and_torchs_matmul_agree():
    r = mw.dot_accumulation(Ks=(64, 2048), rows=64)
    assert _rounds_to_nearest(r, "fp32") and _rounds_to_nearest(r, "torch_matmul")  # one rounding
    assert all(e < (k - 1) * 2 ** -24 for k, e in zip(r["K"], r["fp32_unrounded"]))  # before it
    assert r["bf16"][1] > 0.1 > r["bf16"][0]                           # a bf16 accumulator swamps


def test_the_rounding_check_fails_a_chopping_bug():
    r = mw.dot_accumulation(Ks=(64, 2048), rows=64, to_bf16=_chop_to_bf16)
    assert not _rounds_to_nearest(r, "fp32")
    assert all(m > 0.55 * 2 ** -8 for m in r["fp32"])                  # the mean alone catches it


def test_cli_runs_the_issue_command_line():
    out = subprocess.run([sys.executable, "-m", "labs.precision", "--experiment", "accumulation", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert '"interval": 128' in out.splitlines()[-1]
    bad = subprocess.run([sys.executable, "-m", "labs.precision", "--experiment", "fp4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
