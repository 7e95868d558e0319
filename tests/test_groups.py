"""One rank grid, every group derived from it, degrees validated in one place."""
import pytest

import workers
from labs import groups
from labs.launcher import launch


def test_dp_is_filled_in_and_tp_varies_fastest():
    lay = groups.layout(8, tp=2, pp=2)
    assert (lay.dp, lay.pp, lay.tp) == (2, 2, 2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(5) == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}


def test_cp_sits_between_tp_and_pp():
    lay = groups.layout(8, tp=2, pp=2, cp=2)
    assert (lay.dp, lay.pp, lay.cp, lay.tp) == (1, 2, 2, 2)
    assert lay.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(6) == {"dp": 0, "pp": 1, "cp": 1, "tp": 0}
    both = groups.layout(16, tp=2, pp=2, cp=2)   # dp = 2: the gradient group is dp x cp
    assert both.groups(("dp", "cp")) == [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]]
    with pytest.raises(ValueError, match="not divisible by tp\\*cp\\*pp = 2\\*3\\*1 = 6"):
        groups.layout(8, tp=2, cp=3)


def test_every_rank_is_in_exactly_one_group_per_axis():
    lay = groups.layout(12, tp=2, pp=3)
    for axis in groups.AXES:
        members = sorted(r for g in lay.groups(axis) for r in g)
        assert members == list(range(12))


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=6, tp=4), "not divisible by tp\\*pp = 4\\*1 = 4"),
    (dict(world_size=3, tp=2), "not divisible"),
    (dict(world_size=8, tp=2, dp=3), "use dp=4"),
    (dict(world_size=0), "positive integer"),
    (dict(world_size=4, tp=1.5), "positive integer"),
])
def test_degrees_that_do_not_fit_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        groups.layout(**kwargs)


def test_groups_in_a_running_job():
    results = launch.spawn(workers.tp_group_sum, 4, 2, timeout=60)
    assert [r["tp_sum"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r["tp_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
