"""The labs run on torch 2.11, whose single-tensor collectives still have their old names.

CI installs a newer torch, so this test takes the new names away and checks that `labs.measure.comm`
falls back to the old ones and that a collective through it still gives the right answer.
"""
import importlib

import pytest
import torch
import torch.distributed as dist

from labs.measure import comm


@pytest.fixture
def old_torch_surface(monkeypatch):
    """`labs.measure.comm` re-imported as if on torch 2.11: no all_gather_single / reduce_scatter_single."""
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.delattr(dist, name, raising=False)
    try:
        yield importlib.reload(comm)
    finally:
        monkeypatch.undo()
        importlib.reload(comm)


def test_comm_falls_back_to_the_torch_2_11_names(old_torch_surface):
    assert old_torch_surface.all_gather_single is dist.all_gather_into_tensor
    assert old_torch_surface.reduce_scatter_single is dist.reduce_scatter_tensor


# On a newer torch the old names are deprecated wrappers of the new ones and warn; on 2.11 they are
# the implementation itself.
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_collectives_work_through_the_old_names(old_torch_surface):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.arange(6, dtype=torch.float32)
        gathered, scattered = torch.empty(6), torch.empty(6)
        with old_torch_surface.counting() as tally:
            old_torch_surface.all_gather(gathered, x)
            old_torch_surface.reduce_scatter(scattered, x)
        torch.testing.assert_close(gathered, x, rtol=0, atol=0)  # one rank: a copy, exactly
        torch.testing.assert_close(scattered, x, rtol=0, atol=0)
        assert tally.calls("all_gather") == tally.calls("reduce_scatter") == 1
    finally:
        dist.destroy_process_group()


def test_the_new_names_are_used_when_torch_has_them():
    if not hasattr(dist, "all_gather_single"):
        pytest.skip("this torch has only the old names; the fallback test covers it")
    assert comm.all_gather_single is dist.all_gather_single
    assert comm.reduce_scatter_single is dist.reduce_scatter_single
