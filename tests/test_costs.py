"""The one table of formula bytes (`labs.formulas.costs`): the ring factors, exact, and bad input refused."""
from fractions import Fraction

import pytest

from labs.formulas import costs


def test_ring_factors_per_rank():
    # 2(n-1)/n for an all-reduce, (n-1)/n for the others, the whole payload for a send or a broadcast
    assert costs.factor("all_reduce", 4) == Fraction(3, 2) and costs.factor("all_gather", 4) == Fraction(3, 4)
    assert costs.factor("reduce_scatter", 8) == costs.factor("all_to_all", 8) == Fraction(7, 8)
    assert costs.factor("send", 16) == costs.factor("broadcast", 3) == 1
    assert all(costs.factor(op, 1) == 0 for op in costs.OPS)       # a group of one sends nothing
    # exact: whole bytes stay ints (a byte count compared with counted messages), others are floats
    assert costs.sent("all_reduce", 1020, 4) == 1530 and isinstance(costs.sent("all_gather", 1020, 3), int)
    assert costs.sent("all_reduce", 10, 3) == pytest.approx(40 / 3) and costs.sent("send", 2.5, 2) == 2.5


def test_unknown_ops_and_groups_are_one_sentence():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        costs.factor("allreduce", 4)
    with pytest.raises(ValueError, match="positive whole number of ranks"):
        costs.sent("all_reduce", 8, 0)
