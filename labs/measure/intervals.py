"""How a timing claim is stated: a ratio within one run, its interval, its spread, and a winner only
where the interval excludes 1.

Two variants timed in turns, repeat by repeat, give paired times; the ratio of each pair cancels
most of what a burst of load on the machine did to both. Timings on a shared machine have long
right tails (a process that waits for a core waits a whole scheduler tick), so the summary is the
median of the paired ratios, with the distribution-free interval for a median from order
statistics (the sign test's interval): with the ratios sorted, r_(k) <= median <= r_(n+1-k) holds
with probability 1 - 2 P(B <= k - 1), B ~ Binomial(n, 1/2), whatever the distribution of the
ratios, as long as the repeats are independent (consecutive steps on a shared machine need not
be), and `median_ranks` picks the largest k that keeps that probability at or above the level.
At n = 15 and 95 % that is k = 4: the 4th smallest and the 4th largest of 15 ratios, 96.5 %.
The spread is the smallest and the largest ratio.

`verdict` calls a winner only where the interval excludes 1, and never where more ranks ran than
the machine has cores (their times then measure the scheduler as much as the algorithm).
"""
import math
import os
import statistics

LEVEL = 0.95
UNRESOLVED = "not resolved on this machine"


def cores():
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                                  # not Linux
        return os.cpu_count() or 1


def median_ranks(n, level=LEVEL):
    """(k, coverage): the order statistics r_(k), r_(n+1-k) that bound the median of ``n`` samples
    with probability ``coverage`` >= ``level``; refuses ``n`` too small to reach ``level``."""
    below = 0.0                                             # P(B <= k - 1), B ~ Binomial(n, 1/2)
    k = 0
    while 1 - 2 * (below + math.comb(n, k) / 2 ** n) >= level:
        below += math.comb(n, k) / 2 ** n
        k += 1
    if k == 0:
        smallest = next(m for m in range(1, 64) if 1 - 2 / 2 ** m >= level)
        raise ValueError(f"{n} repeats cannot bound a median at {level:.0%}: take at least {smallest}.")
    return k, 1 - 2 * below


def ratio_interval(numerator, denominator, level=LEVEL):
    """The paired ratios numerator[i] / denominator[i]: their median, its interval, their range.

    Returns median, low, high (the interval), coverage (its exact probability), lowest and
    highest (the spread of the ratios) and n."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired times need as many of each: {len(numerator)} and {len(denominator)}.")
    ratios = sorted(a / b for a, b in zip(numerator, denominator))
    n = len(ratios)
    k, coverage = median_ranks(n, level)
    return {"median": statistics.median(ratios), "low": ratios[k - 1], "high": ratios[n - k],
            "coverage": coverage, "lowest": ratios[0], "highest": ratios[-1], "n": n}


def verdict(interval, faster_if_below, faster_if_above, ranks=1, machine_cores=None):
    """Which variant is faster, named only where the interval excludes 1 and ranks <= cores."""
    machine_cores = cores() if machine_cores is None else machine_cores
    if ranks > machine_cores:
        return UNRESOLVED
    if interval["high"] < 1:
        return faster_if_below
    if interval["low"] > 1:
        return faster_if_above
    return UNRESOLVED
