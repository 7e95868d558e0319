"""Bus bandwidth (labs/data_parallel/bus_bandwidth.py): nccl-tests' factor 2(N-1)/N is what gloo's all-reduce
really writes per rank, per byte of the buffer, plus gloo's preambles and nothing else."""
import pytest

from labs.data_parallel import bus_bandwidth as bb

# 4100 bytes = 1025 fp32 elements: not divisible by 3, so the ring's chunks are ragged.
SIZES = [4096, 4100, 65536, 2**20 + 12]


@pytest.fixture(scope="module")
def three_ranks():
    return bb.sweep(3, SIZES, repeats=1)   # one spawn for every assertion; N = 3: 2(N-1)/N = 4/3


def test_wire_is_ring_payload_plus_gloo_preambles(three_ranks):
    n = three_ranks["world_size"]
    for row in three_ranks["rows"]:
        assert row["wire_reason"] is None                   # gloo on Linux: the wire can be read
        assert row["wire_all_ranks"] == row["wire_all_ranks_model"]   # to the byte, all ranks
        for w in row["wire_bytes"]:
            # per rank: the ring's chunks differ by at most one element per hop (2(N-1) hops)
            assert abs(w - row["wire_all_ranks_model"] / n) <= 4 * 2 * (n - 1)


def test_measured_factor_is_two_n_minus_one_over_n(three_ranks):
    big = three_ranks["rows"][-1]
    assert big["factor"] == pytest.approx(4 / 3)
    # at 1 MiB the preambles are about 0.1 % of S: the measured factor is 2(N-1)/N, not (N-1)/N
    # (a reduce-scatter's), not 2 (the large-N limit) and not 1 (broadcast's)
    assert 0 < big["wire_factor"] - big["factor"] < 2e-3
    assert big["wire_factor"] - big["factor"] <= big["preamble_factor"] + 8 * 2 / big["nbytes"]
    small = three_ranks["rows"][0]
    assert small["wire_factor"] - small["factor"] > 0.2       # at 4 KiB the preambles are not small


def test_bandwidths_follow_nccl_tests_definitions(three_ranks):
    for row in three_ranks["rows"]:
        assert row["algbw"] == row["nbytes"] / row["seconds"]
        assert row["busbw"] == pytest.approx(row["algbw"] * 4 / 3)
    assert bb.bus_factor("all_gather", 4) == bb.bus_factor("reduce_scatter", 4) == 0.75
    assert bb.bus_factor("broadcast", 8) == 1.0 and bb.bus_factor("all_reduce", 8) == 1.75


def test_bad_input_raises():
    with pytest.raises(ValueError, match="unknown collective"):
        bb.bus_factor("all_to_all", 4)
    with pytest.raises(ValueError, match="world_size"):
        bb.bus_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="seconds must be positive"):
        bb.bandwidths(4096, 0.0, 2)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        bb.rank_sweep(0, 1, [6])
