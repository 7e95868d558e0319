"""Chapter 15: a timing claim as a ratio within one run, with an interval, and a winner only when
the interval excludes 1.

Two variants run in interleaved repeats on the same ranks (A B, B A, A B, ...: the order
alternates, so a drift in the machine's load over the run hits both alike). Each repeat gives one
ratio A/B. The claim is the median ratio, and its interval is the distribution-free confidence
interval of a median: with n ratios sorted, [r_(k), r_(n+1-k)] covers the true median with
probability 1 - 2 P(Binomial(n, 1/2) < k), whatever the distribution of the ratios (Conover,
*Practical Nonparametric Statistics*, section 3.2). k is the largest index that keeps that
probability at least ``confidence``.
"""
import math
import statistics


def order(repeats):
    """Which variant runs first in each repeat: alternating, so neither always goes first."""
    return [("a", "b") if i % 2 == 0 else ("b", "a") for i in range(repeats)]


def median_interval(values, confidence=0.95):
    """(median, low, high, achieved confidence) of ``values``; the interval is None when there are
    too few values to reach ``confidence`` with any order statistics. The confidence holds for
    independent values; consecutive steps on a shared machine need not be."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values to take a median of.")
    below = 0.0      # P(Binomial(n, 1/2) < k), grown one k at a time
    best = None
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2**n
        if 1 - 2 * below < confidence:
            break
        best = (k, 1 - 2 * below)
    if best is None:
        return statistics.median(xs), None, None, None
    k, achieved = best
    return statistics.median(xs), xs[k - 1], xs[n - k], achieved


def ratio(a, b, confidence=0.95):
    """The paired ratios a_i / b_i of interleaved repeats: median, interval and the verdict.

    verdict: "a < b" when the whole interval is below 1, "a > b" when above, otherwise
    "not resolved on this machine". Pairs where b is 0 are left out (their count is reported)."""
    if len(a) != len(b):
        raise ValueError(f"paired repeats needed: {len(a)} values of a against {len(b)} of b.")
    pairs = [(x, y) for x, y in zip(a, b) if y > 0]
    if not pairs:
        return {"median": None, "low": None, "high": None, "confidence": None, "n": 0,
                "dropped": len(a), "verdict": "not resolved on this machine"}
    ratios = [x / y for x, y in pairs]
    med, lo, hi, achieved = median_interval(ratios, confidence)
    verdict = "not resolved on this machine"
    if lo is not None and hi < 1:
        verdict = "a < b"
    elif lo is not None and lo > 1:
        verdict = "a > b"
    return {"median": med, "low": lo, "high": hi, "confidence": achieved, "n": len(ratios),
            "dropped": len(a) - len(ratios), "spread": (min(ratios), max(ratios)), "verdict": verdict}
