"""The planner's GEMM time (`kernels.gemm_seconds`, `kernels.gemm_passes`) and the allocator's reserve by
stack (`shapes.reserved_bytes` under expandable segments)."""
import pytest

from labs.formulas.planning import kernels, shapes, software


def test_a_gemm_above_the_ridge_runs_at_one_speed_whatever_its_shape():
    """The model has no per-shape term (the scorecard's docstring: a K / (K + K_0) term from DeepGEMM's
    table was tried and lost on the checked set). The named wrong model: a short reduction K priced slower
    per FLOP than a long one."""
    long_k = kernels.gemm_seconds(4096, 7168, 16384, 1e15, 1e30)
    short_k = kernels.gemm_seconds(4096, 7168, 2048, 1e15, 1e30)
    assert short_k == pytest.approx(long_k * 2048 / 16384)
    assert not hasattr(kernels, "reduction_k0")


def test_backward_is_two_gemms_of_the_forwards_flops_and_bytes():
    """Backward's input gradient (M x N) @ (N x K) and weight gradient (K x M) @ (M x N) move the forward's
    bytes and do its FLOPs, on and below the ridge alike. The named wrong models: backward priced as one
    GEMM, or as three."""
    for M, N, K, bw in ((8192, 8192, 8192, 1e30), (8192, 128, 8192, 3e12), (16, 8192, 8192, 3e12)):
        f, b = kernels.gemm_passes(M, N, K, 1e15, bw)
        assert f == kernels.gemm_seconds(M, N, K, 1e15, bw)
        assert b == pytest.approx(2 * f, rel=1e-12)


def test_expandable_segments_leave_no_reserve():
    """torchtitan's launcher sets expandable segments: its reserved peak is its tensors. The named wrong
    model: GMLake's 15 % added on top (the 8B rows without CP came out 17 to 29 % high)."""
    assert software.TORCHTITAN.expandable_segments and software.TORCHTITAN_2025.expandable_segments
    assert not software.MEGATRON_CORE.expandable_segments
    assert shapes.reserved_bytes(85.0, expandable=True) == 85.0
    assert shapes.reserved_bytes(85.0) == pytest.approx(100.0)
