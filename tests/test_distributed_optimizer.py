"""Chapter 3: the bytes-per-parameter formulas of ZeRO-3, Megatron's distributed optimizer and
FSDP2 (the measured side runs in tests/test_hsdp.py, on the spawn it shares)."""
import pytest

from labs.zero import distributed_optimizer as dopt

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics


def test_formulas_reproduce_the_megatron_table():
    # Megatron Core's "Distributed Optimizer" table: non-distributed (d = 1) 20, 18, 16 bytes
    assert dopt.bytes_per_param("Megatron dist. opt., fp16 params + fp16 grads", 1) == 20
    assert dopt.bytes_per_param("Megatron dist. opt., bf16 params + fp32 grads", 1) == 18
    assert dopt.bytes_per_param("Megatron dist. opt., fp32 params + fp32 grads", 1) == 16
    # at d = 8: 6 + 12/8, against ZeRO-3's 16/8: the unsharded weights and gradients dominate
    assert dopt.bytes_per_param("Megatron dist. opt., bf16 params + fp32 grads", 8) == 7.5
    assert dopt.bytes_per_param("ZeRO-3 (fp16/bf16 + fp32 Adam)", 8) == 2
    assert sum(dopt.FSDP2_PIECES.values()) == dopt.RECIPES["FSDP2, fp32 shards + bf16 compute"][1]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown recipe"):
        dopt.bytes_per_param("ZeRO-4", 8)
    with pytest.raises(ValueError, match="positive"):
        dopt.bytes_per_param("ZeRO-3 (fp16/bf16 + fp32 Adam)", 0)


def test_check_fsdp2_catches_a_rank_keeping_bf16_gradients():
    good = {"params": 40, "grads": 40, "adam_moments": 80, "adam_step": 8, "local_numel": 10}
    assert dopt.check_fsdp2([good, good], 20)["bytes_per_param_per_rank"] == 8
    with pytest.raises(AssertionError, match="grads"):
        dopt.check_fsdp2([good, dict(good, grads=20)], 20)
