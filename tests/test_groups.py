"""One degrees type (`labs.dims.ParallelDims`), every group derived from its rank grid, degrees
validated in one place; the process groups (`labs.groups`) and the DeviceMesh made from it."""
import pytest

import workers
from labs.dims import ParallelDims
from labs.launcher import launch
from labs.formulas import links


def test_dp_is_filled_in_and_tp_varies_fastest():
    lay = ParallelDims.build(8, tp=2, pp=2)
    assert (lay.dp, lay.pp, lay.tp) == (2, 2, 2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(5) == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}


def test_cp_sits_between_tp_and_pp():
    lay = ParallelDims.build(8, tp=2, pp=2, cp=2)
    assert (lay.dp, lay.pp, lay.cp, lay.tp) == (1, 2, 2, 2)
    assert lay.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(6) == {"dp": 0, "pp": 1, "cp": 1, "tp": 0}
    both = ParallelDims.build(16, tp=2, pp=2, cp=2)   # dp = 2: the gradient group is dp x cp
    assert both.groups(("dp", "cp")) == [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]]
    with pytest.raises(ValueError, match="not divisible by tp\\*cp\\*pp = 2\\*3\\*1 = 6"):
        ParallelDims.build(8, tp=2, cp=3)


def test_expert_and_hsdp_groups_split_dp():
    # ep inside dp, between cp and pp (DeepSeek-V3's EP over consecutive GPUs): an ep group is a run
    # of ranks, the edp group (the same experts) is the rest of dp, beyond pp; their product is dp
    e = ParallelDims(dp=4, ep=2, pp=2)
    assert e.groups("ep")[:2] == [[0, 1], [2, 3]] and e.groups("pp")[0] == [0, 2]
    assert e.groups("edp")[0] == [0, 4] and e.groups("dp")[0] == [0, 1, 4, 5]
    assert e.coords(5) == {"dp": 3, "pp": 0, "cp": 0, "tp": 0, "ep": 1, "edp": 1}
    h = ParallelDims(dp=4, dp_replicate=2)            # HSDP: shard inside, replicate across
    assert h.groups("dp_shard") == [[0, 1], [2, 3]] and h.groups("dp_replicate") == [[0, 2], [1, 3]]
    assert [a for a, _ in h.mesh_dims()] == ["dp_replicate", "dp_shard", "pp", "tp"]


def test_folded_experts_cut_each_stage_into_runs():
    # Megatron-Core's folding (ETP = 1): EP 8 beside TP 2 and DP 4 (ep > dp), the expert group a run of a
    # stage's tp x dp ranks, edp the ranks at the same place of each run; ep may not be carved from dp here
    f = ParallelDims(tp=2, pp=2, dp=8, ep=4, fold_ep=True)
    assert f.groups("ep")[:3] == [[0, 1, 4, 5], [8, 9, 12, 13], [16, 17, 20, 21]]
    assert f.groups("edp")[:2] == [[0, 8, 16, 24], [1, 9, 17, 25]]
    assert (f.size("ep"), f.size("edp"), f.size("dp")) == (4, 4, 8)
    assert f.groups("dp") == ParallelDims(tp=2, pp=2, dp=8).groups("dp")   # folding moves no dense group
    assert f.coords(13) == {"dp": 3, "pp": 0, "cp": 0, "tp": 1, "ep": 3, "edp": 1}
    for axis in ("ep", "edp"):
        assert sorted(r for g in f.groups(axis) for r in g) == list(range(f.world_size))
    long = ParallelDims(tp=4, cp=8, pp=8, dp=1, ep=8, fold_ep=True)   # the ModelZoo's CP 8 row
    assert long.groups("ep")[1] == list(range(8, 16)) and long.size("edp") == 4
    with pytest.raises(ValueError, match="not a dimension of one DeviceMesh"):
        long.mesh_dims()
    with pytest.raises(ValueError, match="ep = 3 does not divide tp\\*cp\\*dp = 8"):
        ParallelDims(tp=2, dp=4, ep=3, fold_ep=True)
    with pytest.raises(ValueError, match="fold_ep=True"):
        ParallelDims(tp=2, dp=4, ep=8)


def test_every_rank_is_in_exactly_one_group_per_axis():
    lay = ParallelDims.build(12, tp=2, pp=3)
    for axis in ("tp", "cp", "pp", "dp", ("dp", "cp")):
        members = sorted(r for g in lay.groups(axis) for r in g)
        assert members == list(range(12))


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=6, tp=4), "not divisible by tp\\*pp = 4\\*1 = 4"),
    (dict(world_size=3, tp=2), "not divisible"),
    (dict(world_size=8, tp=2, dp=3), "use dp=4"),
    (dict(world_size=0), "positive integer"),
    (dict(world_size=4, tp=1.5), "positive integer"),
    (dict(world_size=6, ep=4), "ep = 4 does not divide dp = 6"),
    (dict(world_size=6, dp_replicate=4), "dp_replicate = 4 does not divide dp = 6"),
    (dict(world_size=8, ep=2, dp_replicate=2), "not both"),
    (dict(world_size=8, order=("tp", "pp", "dp")), "order must list"),
])
def test_degrees_that_do_not_fit_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims.build(**kwargs)


def test_groups_and_mesh_in_a_running_job():
    # the process groups and the DeviceMesh (dp flattened from edp and ep, which pp separates) hold
    # the same ranks as the grid's lists
    results = launch.spawn(workers.tp_group_sum, 4, 2, timeout=60)
    assert [r["tp_sum"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r["tp_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    e = ParallelDims(dp=2, ep=2, pp=2)
    meshes = launch.spawn(workers.mesh_groups, 4, e, timeout=60)
    for rank, got in enumerate(meshes):
        for axis, ranks in got.items():
            assert ranks in e.groups(axis) and rank in ranks, (rank, axis)
    assert set(meshes[0]) == {"dp", "edp", "ep", "pp", "tp"}


def test_folded_expert_groups_are_placed_one_by_one():
    # a folded expert group is no atom of the grid: its nodes are counted group by group (TP 2 x DP 16 of a
    # stage spread over the pp stride: two ranks on each of 16 nodes), and it combines with no other axis
    f = ParallelDims(tp=2, pp=8, dp=16, ep=32, fold_ep=True)
    assert links.group_nodes(f, "ep", 8) == max(f.group_nodes("ep", 8)) == 16
    for bad in (lambda: f.size(("edp", "cp")), lambda: links.group_nodes(f, ("edp", "cp"), 8)):
        with pytest.raises(ValueError, match="cannot combine ep or edp"):
            bad()
