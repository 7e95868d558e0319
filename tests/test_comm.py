"""Counted collectives: the results are the library's, the bytes are the ring's, exactly."""
import pytest
import torch

import workers
from labs import comm, launch


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


@pytest.mark.parametrize("world_size,numel", [(2, 8), (3, 10), (4, 7)])
def test_collectives_are_correct_and_counted(world_size, numel):
    results = launch.spawn(workers.count_collectives, world_size, numel, timeout=90)
    n = world_size
    base = torch.arange(numel, dtype=torch.float32)
    for rank, r in enumerate(results):
        out, ops = r["out"], r["tally"]["ops"]
        torch.testing.assert_close(out["all_reduce"], n * base + sum(range(n)), rtol=0, atol=0)
        torch.testing.assert_close(out["all_gather"], torch.arange(n).float().repeat_interleave(4))
        torch.testing.assert_close(out["reduce_scatter"], n * torch.arange(4 * rank, 4 * rank + 4).float())
        torch.testing.assert_close(out["broadcast"], torch.zeros(5))
        torch.testing.assert_close(out["ring_p2p"], torch.full((3,), float((rank - 1) % n)))
        assert ops["all_reduce"]["bytes_sent"] == 4 * comm.ring_allreduce_elements(numel, n, rank)
        assert ops["all_gather"]["bytes_sent"] == (n - 1) * 4 * 4
        assert ops["reduce_scatter"]["bytes_sent"] == (n - 1) * 4 * 4
        assert ops["send"] == {"calls": 1, "bytes_sent": 12, "bytes_received": 0}
        assert ops["recv"] == {"calls": 1, "bytes_sent": 0, "bytes_received": 12}
    # every byte sent is received by someone
    assert sum(r["tally"]["bytes_sent"] for r in results) == sum(r["tally"]["bytes_received"] for r in results)
    assert sum(r["tally"]["ops"]["all_reduce"]["bytes_sent"] for r in results) == 2 * (n - 1) * numel * 4
    # a broadcast chain: every rank but the last sends M once
    assert sum(r["tally"]["ops"]["broadcast"]["bytes_sent"] for r in results) == (n - 1) * 5 * 4
