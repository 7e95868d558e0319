"""Chapter 5: the bubble in wall-clock time, checked against a planted serialisation.

The logical clock (`executor`) checks a schedule's order and dependencies; only wall-clock time can
show an executor that ran its stages one at a time. A fixed bound on the wall-clock bubble cannot
tell that bug from a loaded machine, which stretches every run. So each schedule runs twice in one
job, one run right after the other: once correctly and once with the planted bug, `OneDevice`, a
lock that every stage holds while it works, as if all stages shared one device. `check` then asks
three things of the correct run, none of which load can fail:

- its bubble is not below the formula (beyond timer granularity): busy time is the schedule's
  nominal work (`executor.wall_bubble`), so load only lengthens the wall and adds idle time;
- some two stages worked at the same time (`overlap`); under the lock none ever do, exactly;
- its bubble is below the serialised run's, timed beside it under the same load.

Under the lock the stages' padded work never overlaps, so the planted run idles at least
1 - 1/p of its time whatever the load; `tests/test_pipeline.py` shows that it fails `check`.
"""
import fcntl
import os
import tempfile

from labs.launcher import launch
from labs.pipeline import executor


class OneDevice:
    """The planted bug: one lock (a file lock, so it spans processes) held by a stage while it
    works. Picklable before first use, so it travels to the ranks with the job's arguments."""

    def __init__(self, path):
        self.path, self._file = path, None

    def acquire(self):
        if self._file is None:
            self._file = open(self.path, "a")
        fcntl.flock(self._file, fcntl.LOCK_EX)

    def release(self):
        fcntl.flock(self._file, fcntl.LOCK_UN)


def busy(events):
    """Each action's busy interval on the wall clock: from its start (its message in) for its
    nominal work (the padding target), as `executor.wall_bubble` counts it."""
    return [(e["wall_start"], e["wall_start"] + e["wall_work"]) for e in events]


def overlap(events):
    """Seconds during which at least two stages were busy at once (events: one list per stage)."""
    edges = sorted((t, d) for evs in events for a, b in busy(evs) for t, d in ((a, 1), (b, -1)))
    total, working, last = 0.0, 0, None
    for t, d in edges:
        if working >= 2:
            total += t - last
        working, last = working + d, t
    return total


def check(run, serialised):
    """Assert that ``run`` (an `executor.sweep` result) idled neither less than its dependencies
    force nor like a serialised executor; ``serialised`` is the same schedule under `OneDevice`.
    It catches full serialisation only: a blocking send, a per-message delay or a lock over some
    stages leaves two stages busy at once and below the serialised run, and passes."""
    name, formula = run["schedule"], run["bubble_fraction_formula"]
    wall, serial = run["bubble_fraction_wallclock"], serialised["bubble_fraction_wallclock"]
    # below the formula: no executor that keeps its dependencies idles less. Busy is nominal work,
    # so load cannot lower the bubble; the 0.02 is a guard for timer granularity alone
    assert wall - formula > -0.02, (name, wall, formula)
    # one at a time: no two stages ever busy together, which load cannot bring about (its padded
    # work is sleep, which needs no core)
    assert overlap(run["events"]) > 0, (name, "no two stages ever worked at the same time")
    # and less idle than the same schedule serialised, timed beside it under the same load
    assert wall < serial, (name, wall, serial)
    return {"schedule": name, "m": run["microbatches"], "wall": wall, "formula": formula,
            "serialised": serial, "overlap_s": overlap(run["events"])}


def paired(p, configs, unit_seconds, timeout=600):
    """Run each (schedule, m, v) correctly and then serialised, in one job of ``p`` ranks; returns
    [(run, serialised), ...] in the order of ``configs``."""
    fd, path = tempfile.mkstemp(prefix="labs-one-device-")
    os.close(fd)
    try:
        lock = OneDevice(path)
        jobs = [c for name, m, v in configs for c in ((name, m, v), (name, m, v, lock))]
        out = launch.spawn(executor.sweep, p, jobs, unit_seconds, timeout=timeout)[0]
    finally:
        os.remove(path)
    return list(zip(out[0::2], out[1::2]))
