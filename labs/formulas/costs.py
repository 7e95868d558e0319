"""Formula bytes: what one rank sends in one call of a collective, the one table every chapter uses.

For a payload of M bytes on a group of n ranks, with bandwidth-optimal algorithms (the ring of
Patarasuk & Yuan 2009; the factors nccl-tests reports its bus bandwidth with, NVIDIA nccl-tests
doc/PERFORMANCE.md), M being the full buffer: the all-reduce's input, the all-gather's output, the
reduce-scatter's input, the all-to-all's input:

    all_reduce       2(n-1)/n M      a reduce-scatter then an all-gather
    all_gather        (n-1)/n M      every rank receives the n-1 shards it lacks, and forwards them
    reduce_scatter    (n-1)/n M
    all_to_all        (n-1)/n M      each rank keeps 1/n of its input
    broadcast             1   M      pipelined: every rank but the last forwards the whole buffer
    send                  1   M      one point-to-point message

These are formulas. Counted messages (`labs.measure.comm`) and the library's wire bytes
(`labs.measure.wire`) are measurements and never come from this table.
"""
from fractions import Fraction

RING = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}   # k in k(n-1)/n
WHOLE = ("broadcast", "send")                                                       # 1 x M
OPS = tuple(RING) + WHOLE


def factor(op, n):
    """Bytes one rank sends per byte of payload, as an exact fraction (0 on a group of one)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; use one of {', '.join(OPS)}.")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a group has a positive whole number of ranks, got {n!r}.")
    if n == 1:
        return Fraction(0)
    return Fraction(1) if op in WHOLE else Fraction(RING[op] * (n - 1), n)


def sent(op, payload, n):
    """Formula bytes one rank sends for one call of ``op`` with payload M = ``payload`` on n ranks:
    an int when the fraction comes out whole (as it does when n divides the buffer), else a float."""
    out = factor(op, n) * (Fraction(payload) if isinstance(payload, int) else payload)
    if isinstance(out, Fraction):
        return out.numerator if out.denominator == 1 else float(out)
    return out
