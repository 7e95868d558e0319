"""DDP internals (labs/data_parallel/ddp_internals.py): bucket rebuild, gradient_as_bucket_view, unused
parameters and the bf16 compression hook, all from one spawn on 3 ranks."""
import pytest

from labs.data_parallel import ddp_internals as di
from labs.launcher import launch

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics

# Gradients here are ~1e-3; fp32 sums of 3 terms in another order differ by a few ulps (~1e-10).
GRAD_BOUND = 1e-7


@pytest.fixture(scope="module")
def tour():
    return launch.spawn(di.tour, 3, timeout=120)


def test_buckets_rebuilt_in_gradient_ready_order(tour):
    for r in tour:
        o = r["order"]
        assert o["predicted_ready"] == [1, 3, 0, 2]            # from the model: reverse of forward's use
        assert o["predicted_ready"] not in (o["registration"], o["registration"][::-1])
        first, *later = o["steps"]
        assert first == [(0, [0, 1, 2, 3])]                     # step 1: one bucket of everything
        for step in later:                                      # then one bucket per layer, ready order
            assert step == [(i, [layer]) for i, layer in enumerate(o["predicted_ready"])]
        # find_unused_parameters: reverse registration order, never rebuilt
        for step in r["order_find_unused"]["steps"]:
            assert step == [(i, [layer]) for i, layer in enumerate([3, 2, 1, 0])]


def test_gradient_as_bucket_view_saves_one_copy(tour):
    for r in tour:
        assert r["view"]["grads_in_buckets"] and not r["copy"]["grads_in_buckets"]
        assert r["view"]["distinct_bytes"] == r["view"]["grad_bytes"] == 4 * 4 * di.WIDTH ** 2
        assert r["copy"]["distinct_bytes"] == 2 * r["copy"]["grad_bytes"]


def test_unused_parameter_error_and_both_fixes(tour):
    for r in tour:
        u = r["unused"]
        assert di.UNFINISHED in u["plain"]["error"] and u["plain"]["failed_at_step"] == 1
        for fix in ("find_unused_parameters", "static_graph"):
            assert u[fix]["error"] is None and u[fix]["max_grad_diff"] < GRAD_BOUND
            assert u[fix]["unused_grad"] is None                # DDP leaves the unused .grad alone


def test_bf16_hook_halves_the_wire_and_stays_within_its_bound(tour):
    c = [r["compression"] for r in tour]
    assert c[0]["dtype"] == "torch.bfloat16"                    # gloo accepts a bf16 all-reduce
    assert c[0]["payload_hook"] * 2 == c[0]["payload_fp32"] == 4 * 4 * di.WIDTH ** 2
    # the library's wire bytes, all ranks: exactly gloo's ring for these buckets, in each dtype
    assert sum(x["wire_fp32"] for x in c) == c[0]["model_fp32_all_ranks"]
    assert sum(x["wire_hook"] for x in c) == c[0]["model_hook_all_ranks"]
    assert 0.5 < c[0]["wire_hook"] / c[0]["wire_fp32"] < 0.51  # halved, plus unchanged preambles
    for x in c:
        assert x["within_bound"]                                # elementwise, see rounding_bound
        assert x["hook_err"] > 100 * x["fp32_err"]              # the bf16 error is real, not fp32's
        assert x["hook_rel_err"] < 4 * di.BF16_U                # a few bf16 roundings, no more
