"""The planner's GEMM speed by shape (`kernels.gemm_seconds`'s K_0, from DeepGEMM's published table) and the
allocator's reserve by stack (`shapes.reserved_bytes` under expandable segments)."""
import pytest

from labs.formulas.planning import kernels, shapes, software

# DeepGEMM README at a6d97a1c, "Normal GEMMs for dense models", M = 4,096: (N, K, TFLOP/s)
PUBLISHED = ((7168, 16384, 1358), (7168, 2048, 1025), (32768, 512, 590), (24576, 1536, 990),
             (4096, 7168, 1304))


def speed(M, N, K, k0):
    """TFLOP/s of a GEMM on an ideal 1,358 TFLOP/s machine with no memory bound."""
    return 2 * M * N * K / kernels.gemm_seconds(M, N, K, 1358e12 * (16384 + k0) / 16384, 1e30, k0) / 1e12


def test_a_gemm_that_ignores_shape_is_refused():
    """The named wrong model: every GEMM above the ridge at the same speed. DeepGEMM's K = 512 runs at 43 %
    of its K = 16,384; a model without K_0 says 100 %."""
    assert speed(4096, 32768, 512, 0.0) == pytest.approx(1358)          # the wrong model
    assert speed(4096, 32768, 512, kernels.K0_FP8) < 0.5 * 1358


@pytest.mark.parametrize("N,K,published", PUBLISHED)
def test_k0_reproduces_the_published_rows(N, K, published):
    """K_0 is solved on the two N = 7,168 rows; the other rows land within 6 % of the table."""
    assert speed(4096, N, K, kernels.K0_FP8) == pytest.approx(published, rel=0.06)


def test_k0_is_solved_not_fitted():
    assert kernels.K0_FP8 == pytest.approx(797.4, abs=0.1)
    assert kernels.reduction_k0(False) == kernels.K0_FP8 / 2


def test_backward_reduces_over_the_other_axes():
    """A narrow slice (N = 128, a K/V projection under TP 8) is cheap forward and slow backward: its input
    gradient reduces over N. The named wrong model: backward = twice forward."""
    f, b = kernels.gemm_passes(8192, 128, 8192, 1e15, 1e30, 400.0)
    assert b > 2.5 * f
    f, b = kernels.gemm_passes(8192, 8192, 8192, 1e15, 1e30, 0.0)
    assert b == pytest.approx(2 * f)


def test_expandable_segments_leave_no_reserve():
    """torchtitan's launcher sets expandable segments: its reserved peak is its tensors. The named wrong
    model: GMLake's 15 % added on top (the 8B rows without CP came out 17 to 29 % high)."""
    assert software.TORCHTITAN.expandable_segments and software.TORCHTITAN_2025.expandable_segments
    assert not software.MEGATRON_CORE.expandable_segments
    assert shapes.reserved_bytes(85.0, expandable=True) == 85.0
    assert shapes.reserved_bytes(85.0) == pytest.approx(100.0)
    assert shapes.usable_bytes(shapes.DGX_H100, True) == shapes.DGX_H100.hbm_bytes
