"""Loss normalisation (labs/data_parallel/loss_reduction.py): sum / global token count matches one process;
per-micro-batch means do not, by exactly the reweighting the formula predicts."""
import pytest

from labs.data_parallel import loss_reduction as lr

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def three_ranks():
    # one spawn shared by every distributed assertion: dp = 3 ranks, K = 2 unequal micro-batches each
    return lr.compare(3, 2)


def test_right_reduction_equals_one_process(three_ranks):
    r = three_ranks
    assert r["right_err"] < lr.BOUND                     # fp32 summation order only
    assert abs(r["loss_right"] - r["loss_single"]) < lr.BOUND * r["loss_single"]
    # every rank holds the same reduced gradient, bit for bit: a ring all-reduce computes each
    # chunk's sum once and copies it to the other ranks
    assert r["replicas_equal"]
    assert r["n_global"] == sum(map(sum, r["counts"]))   # the all-reduced count is the total


def test_naive_reduction_is_the_reweighted_objective(three_ranks):
    r = three_ranks
    assert len({n for row in r["counts"] for n in row}) > 1   # the counts really differ
    assert r["naive_err"] > lr.MARGIN                          # the bug, far above rounding
    assert r["naive_vs_formula"] < lr.BOUND                    # and exactly 1/(R K n_rk) per token
    assert abs(r["loss_naive"] - r["loss_weighted"]) < lr.BOUND * r["loss_single"]


def test_gradient_accumulation_alone_one_process():
    r = lr.compare(1, 4)   # the transformers case: one device, K = 4 micro-batches of unequal length
    assert r["right_err"] < lr.BOUND and r["naive_err"] > lr.MARGIN
    assert r["naive_vs_formula"] < lr.BOUND


def test_equal_counts_make_naive_right():
    r = lr.compare(1, 3, padded=False)   # control: no padding, every n_k = b s
    assert len({n for row in r["counts"] for n in row}) == 1
    assert r["naive_err"] < lr.BOUND and r["right_err"] < lr.BOUND


def test_global_batch_arithmetic_and_llama3_table4():
    assert lr.global_batch_size(2, 4, 3, seq=16) == {"sequences": 24, "tokens": 384}
    rows = lr.llama3_global_batches()
    assert [row["tokens"] for row in rows] == [2**24, 2**24, 2**23]   # 64*32*8192, 128*16*8192, 4*16*131072
    assert [row["matches_16M"] for row in rows] == [True, True, False]
    t = lr.noise_scale_tradeoff(1.0)
    assert t == {"steps_over_min": 2.0, "examples_over_min": 2.0}


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bad_sizes_raise(bad):
    with pytest.raises(ValueError, match="positive integer"):
        lr.global_batch_size(bad, 1, 1)
    with pytest.raises(ValueError, match="positive"):
        lr.noise_scale_tradeoff(0 if bad is None else -1.5 if bad == 1.5 else bad)
