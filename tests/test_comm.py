"""labs.measure.comm: three kinds of bytes kept apart, hand rings equal to the library, gloo's wire
measured."""
import functools

import pytest
import torch

import workers
from labs.measure import comm, wire
from labs.launcher import launch

# The tests marked `numerics` compare floating-point results: `make test` runs them under
# another CPU's rounding. The others compare bytes, counts, schedules or refusals.


@functools.lru_cache(maxsize=None)
def suite(world_size):
    """One spawn per world size for all the checks below (a spawn costs seconds on 2 cores)."""
    return launch.spawn(workers.comm_suite, world_size, timeout=300)


@pytest.mark.numerics
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [10, 12, 7])
def test_ring_allreduce_bytes_sum_to_2_n_minus_1_times_m(n, numel):
    per_rank = [comm.ring_allreduce_elements(numel, n, r) for r in range(n)]
    assert sum(per_rank) == 2 * (n - 1) * numel
    # each rank is within one element (one chunk's rounding) of 2(N-1)/N * M
    assert all(abs(e - 2 * (n - 1) * numel / n) <= 2 * (n - 1) / n + 1e-9 for e in per_rank)


def test_ring_chunks_are_uneven_by_at_most_one():
    assert comm.ring_chunks(10, 3) == [4, 3, 3]
    assert comm.ring_chunks(2, 4) == [1, 1, 0, 0]


@pytest.mark.numerics
def test_library_collectives_are_correct_and_recorded_as_formula_not_counted():
    world_size, numel = 3, 10
    results = [r["library"] for r in suite(world_size)]
    n = world_size
    base = torch.arange(numel, dtype=torch.float32)
    for rank, r in enumerate(results):
        out, tally, ops = r["out"], r["tally"], r["tally"]["ops"]
        # small integers in fp32: every partial sum is exact, whatever the order, so no tolerance
        torch.testing.assert_close(out["all_reduce"], n * base + sum(range(n)), rtol=0, atol=0)
        torch.testing.assert_close(out["all_gather"], torch.arange(n).float().repeat_interleave(4))
        torch.testing.assert_close(out["reduce_scatter"], n * torch.arange(4 * rank, 4 * rank + 4).float())
        torch.testing.assert_close(out["broadcast"], torch.zeros(5))
        torch.testing.assert_close(out["ring_p2p"], torch.full((3,), float((rank - 1) % n)))
        # a library collective's bytes are a formula, never counted messages
        assert tally["bytes_sent"] == 12 and tally["bytes_received"] == 12  # only the point-to-point pair
        assert all(ops[op]["bytes_sent"] == 0 for op in ("all_reduce", "all_gather", "reduce_scatter",
                                                         "broadcast"))
        assert ops["all_reduce"]["formula_bytes_sent"] == 4 * comm.ring_allreduce_elements(numel, n, rank)
        assert (ops["all_gather"]["formula_bytes_sent"] == ops["reduce_scatter"]["formula_bytes_sent"]
                == (n - 1) * 16)
        # payloads are the tensors the calls were made with
        assert ([ops[op]["payloads"] for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")]
                == [[numel * 4], [16], [n * 16], [20]])
        assert ops["send"]["bytes_sent"] == 12 and ops["recv"]["bytes_received"] == 12
        assert ops["send"]["calls"] == ops["recv"]["calls"] == 1
    assert sum(r["tally"]["formula_bytes_sent"] for r in results) == \
        sum(r["tally"]["formula_bytes_received"] for r in results)
    # a broadcast chain: every rank but the last sends M once
    assert sum(r["tally"]["ops"]["broadcast"]["formula_bytes_sent"] for r in results) == (n - 1) * 5 * 4
    # counting(wire=True): the synchronous all-reduce is measured, the async one is listed as missing
    checks = [r["wire_checks"] for r in results]
    for x in checks:
        ops = x["tally"]["ops"]["all_reduce"]
        assert ops["calls"] == 2 and ops["wire_bytes_sent"] == x["wire"]
        assert x["tally"]["wire_missing"] == [
            "all_reduce: async_op=True, the window cannot close when the data has gone"]
        assert x["missing"]["bytes"] is None
        assert x["missing"]["reason"].startswith("/proc/self/io cannot be read here (no such file)")
    assert sum(x["wire"] for x in checks) == wire.gloo_allreduce_all_ranks(4000, n)


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_hand_rings_equal_the_library_and_count_n_minus_1_chunks(world_size):
    """Integer-valued inputs: every partial sum is exact in fp32 and bf16, so equality is exact."""
    results = [r["hand"] for r in suite(world_size)]
    k, numel = 10, 13
    for rank, r in enumerate(results):
        cases = [(world_size, c) for c in r["world"].values()] + ([(3, r["subgroup"])] if "subgroup" in r
                                                                  else [])
        for n, c in cases:
            assert all(c["equal"].values()), c["equal"]
            assert c["async_done"]
            chunk = k * c["element_size"]
            # reduce-scatter and all-gather: N-1 chunks out, N-1 in; all-reduce: both phases
            assert c["sent"] == c["received"] == {"reduce_scatter": (n - 1) * chunk,
                                                  "all_gather": (n - 1) * chunk,
                                                  "all_reduce": 2 * (n - 1) * chunk}
            assert c["formula"] == 0  # nothing went through the library inside hand_collectives()
            assert c["payload"] == {"all_reduce": n * chunk, "reduce_scatter": n * chunk, "all_gather": chunk}
        for n, u in [(world_size, r["uneven"])] + ([(3, r["subgroup_uneven"])] if "subgroup_uneven" in r
                                                   else []):
            assert u["rs_equal"] and u["ag_equal"] and u["max_equal"]
            assert u["sizes"] == comm.ring_chunks(numel, n)
        assert r["errors"][0] == (f"reduce_scatter needs the full tensor to be {world_size} times the shard: "
                                  f"got {3 * world_size + 1} and 3 elements on {world_size} ranks.")
        assert r["errors"][1].startswith("the hand ring reduces with SUM, PRODUCT, MAX or MIN")
    if world_size == 4:
        assert "subgroup" not in results[1] and all("subgroup" in results[i] for i in (0, 2, 3))
        # uneven chunks [5, 4, 4] on the subgroup: the three rings (RS, AG, all-reduce) move 4 x 13 elements
        assert sum(results[i]["subgroup_uneven"]["sent"] for i in (0, 2, 3)) == 4 * (3 - 1) * numel * 4


# gloo's wire, exactly: payload plus 48-byte preambles, three per message (two written by the
# sender, one by the receiver), as labs.measure.wire models it from gloo's source. No tolerance is needed
# because wchar counts bytes handed to writev, partial writes included; a window that caught a
# barrier (96-144 bytes per rank), a printed warning or a file write would break the equality.
def test_wire_table_is_gloo_payload_plus_preambles():
    world_size, nbytes = 4, 4_000_000
    results = [r["wire_table"] for r in suite(world_size)]
    n = world_size
    measured = {op: [r["ops"][op]["wire_bytes"] for r in results] for op in results[0]["ops"]}
    ring = {op: [r["ops"][op]["formula_bytes"] for r in results] for op in results[0]["ops"]}
    assert all(r["wire_reason"] is None for r in results)
    assert sum(measured["all_reduce"]) == wire.gloo_allreduce_all_ranks(nbytes, n)
    assert sum(measured["all_reduce"]) - sum(ring["all_reduce"]) < 0.001 * sum(ring["all_reduce"])
    # gloo runs a full all-reduce for reduce-scatter
    assert measured["reduce_scatter"] == measured["all_reduce"]
    assert sum(ring["reduce_scatter"]) * 2 == sum(ring["all_reduce"])  # twice what the ring needs
    # all-gather: (N-1) shards, each step in two halves: 2(N-1) messages sent and as many received
    assert measured["all_gather"] == [(n - 1) * nbytes // n + 3 * wire.PREAMBLE * 2 * (n - 1)] * n
    assert measured["all_gather"] == [wire.gloo_all_gather(nbytes, n)] * n
    # binomial tree: the root sends M to ceil(log2 N) peers, leaves only listen
    assert measured["broadcast"] == [wire.gloo_broadcast(nbytes, n, rank) for rank in range(n)]
    assert [wire.gloo_broadcast_messages(n, rank) for rank in range(n)] == [(2, 0), (1, 1), (0, 1), (0, 1)]
    # the figures, per rank: 6.0, 6.0, 3.0 and 8.0 MB
    firsts = [measured[op][0] for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")]
    assert [w // 1000 for w in firsts] == [6001, 6001, 3000, 8000]
