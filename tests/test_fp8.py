"""Chapter 8: FP8 scaling granularity, limited-precision accumulation, FP8 bytes through gloo."""
import subprocess
import sys

import pytest
import torch

from labs.precision import fp8

# compares floating-point results: `make test` runs it again under another CPU's rounding
pytestmark = pytest.mark.numerics


def test_block_scaling_beats_per_tensor_on_outlier_channels():
    r = fp8.matmul_error()
    e, z = r["errors"], r["x_zero_fraction"]
    assert e["block"] < e["row"] < e["tensor"]
    assert z["block"] < z["tensor"] / 5  # per-tensor flushes the ordinary channels to zero
    # _scaled_mm multiplies the same FP8 operands the emulation dequantises; fp32 accumulation
    # order differs: 1e-6 relative
    assert r["scaled_mm_vs_emulated"] < 1e-6


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
    assert pro[2] < lim[2] / 10          # promotion every 128 keeps it flat
    assert max(pro) < 2 ** -12


def test_round_to_bits():
    s = torch.tensor([1 + 2 ** -13, 1 + 2 ** -14, 3.0], dtype=torch.float64)
    assert fp8.round_to_bits(s, 14).tolist() == [1 + 2 ** -13, 1.0, 3.0]  # ties to even


@pytest.mark.parametrize("world_size", [3])
def test_fp8_allgather_sends_half_the_bytes_of_bf16(world_size):
    r = fp8.allgather_bytes(world_size, numel=1000)
    assert r["gloo_refuses_fp8"]                             # FP8 cannot be sent as FP8
    assert r["bf16_payload"] == 2 * r["fp8_payload"] == 2000  # counted payload, from the tensors
    assert r["scale_payload"] == 4                           # one fp32 scale per rank
    assert r["fp8_formula_sent"] == (world_size - 1) * (1000 + 4)


def test_cli_runs_the_issue_command_line():
    out = subprocess.run([sys.executable, "-m", "labs.precision", "--experiment", "accumulation", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert '"interval": 128' in out.splitlines()[-1]
    bad = subprocess.run([sys.executable, "-m", "labs.precision", "--experiment", "fp4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
