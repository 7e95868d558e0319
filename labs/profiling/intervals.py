"""Chapter 15: sets of time intervals, the arithmetic every trace quantity is made of.

An interval set is a sorted list of disjoint (start, end) pairs. Taking the union first is what
keeps nested events from being counted twice: ``aten::linear`` [0, 10] holding ``aten::addmm``
[1, 9] is 10 microseconds of work, not 18.
"""
import bisect


def union(intervals):
    """Merge (start, end) pairs, in any order and overlapping, into a sorted disjoint set."""
    out = []
    for a, b in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(x, y):
    """The time in both sets (each a disjoint sorted set, as `union` returns)."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x, y):
    """The time in ``x`` and not in ``y`` (``y`` a disjoint sorted set, as `union` returns): for each
    interval of ``x``, only the intervals of ``y`` that can overlap it are visited (bisect)."""
    ends = [d for _, d in y]
    out = []
    for a, b in x:
        start, k = a, bisect.bisect_right(ends, a)   # the first of y ending after a
        while k < len(y) and y[k][0] < b:
            c, d = y[k]
            if c > start:
                out.append((start, c))
            start = max(start, d)
            if start >= b:
                break
            k += 1
        if start < b:
            out.append((start, b))
    return out


def length(x):
    return sum(b - a for a, b in x)


def clip(x, window):
    """The part of ``x`` inside one (start, end) window."""
    return intersect(x, [window])
