"""Chapter 6: each exercise checker accepts its computed answer and refuses the wrong answer a
source note or a careless reader gives. A checker that compared an answer with itself, or whose
tolerance swallowed the usual mistake, would fail here.

Each wrong answer is computed from the mistake it stands for, not typed in. Plain arithmetic on
Python floats, no spawned ranks: not marked `numerics`.
"""
from fractions import Fraction

import pytest

import exercise_cases

from labs.context_parallel import crossover, methods as cp, sequence_parallel as sp
from labs.memory_budget import activations, budget

MIB = 2**20
S, H, A, T = 2048, 12288, 96, 4                        # GPT-3 175B (Brown et al. 2020, Table 2.1), t = 4
M = 1 * S * H * 2                                      # one bf16 activation of the layer, b = 1
PEAK = budget.PEAK_FLOPS["H100 SXM, bf16 dense"]
IB = budget.LINKS["InfiniBand NDR (400 Gb/s)"]


def gpt3(**kw):
    return activations.gpt3_activation_bytes_per_layer(S, 1, H, A, tp=T, **kw) / MIB


CASES = [
    # 1: the activations one layer keeps per rank under TP + SP, sbh(34/t + 5as/(ht))
    (sp, "1", gpt3(), "the TP-only row sbh(10 + 24/t + 5as/(ht)): the 10sbh left whole"),
    (sp, "1", S * H * (34 / T + 5 * A * S / H) / MIB, "the scores' 5as/h not divided by t"),
    (sp, "1", activations.gpt3_activation_bytes_per_layer(S, 1, H, A) / MIB,
     "the unsplit layer's, not one rank's"),
    (sp, "1", activations.gpt3_activation_bytes_per_layer(S, 1, H, A, tp=8, sp=True) / MIB,
     "the page's t = 8 used: the exercise asks for t = 4"),
    # 2: two all-gathers and two reduce-scatters of M, (t-1)/t M each
    (sp, "2", 2 * (T - 1) / T * M / MIB, "the all-gathers only: the reduce-scatters left out"),
    (sp, "2", 4 * M / MIB, "all of M per collective: the ring's (t-1)/t left out"),
    (sp, "2", 4 * 2 * (T - 1) / T * M / MIB, "each of SP's four collectives priced as an all-reduce"),
    # 3: causal, zig-zag: half a tile per step, 2hc^2/F >= 4ch/W, c >= 2F/W tokens
    (cp, "3", PEAK / IB, "F/W: the full-tile condition, the causal half tiles left out"),
    (cp, "3", 4 * PEAK / IB, "only Q K^T counted, hc^2 FLOPs per half tile: c >= 4F/W"),
    (cp, "3", 2 * PEAK / 400e9, "NDR's 400 Gb/s read as 400 GB/s"),
    # 4: with GQA only a_kv/a of the bytes travel: c >= 2 (a_kv/a) F/W
    (cp, "4", 2 * PEAK / IB, "GQA left out: exercise 3's answer"),
    (cp, "4", 2 * PEAK / IB * 64 / 8, "a/a_kv instead of a_kv/a: the ratio inverted"),
    (cp, "4", PEAK / IB * 8 / 64, "(a_kv/a) F/W: the full-tile condition, the causal half tiles left out"),
    # 5: the ratio above which Ulysses sends fewer bytes than the all-gather at cp = 8, a = 64
    (cp, "5", 1 / 8, "1/cp (Ulysses' (cp-1)/cp share taken for the crossover) or cp/a (where Ulysses "
                     "starts copying KV heads), both 1/8 here"),
    (cp, "5", float(crossover.crossover("ring", 8, 64)), "the ring's crossover, not the all-gather's"),
]


def _check(module):
    return sp.check if module is sp else cp.check_answer


@pytest.mark.parametrize("module, question, wrong, mistake", CASES, ids=exercise_cases.ids(CASES))
def test_the_checker_refuses_the_usual_mistake(module, question, wrong, mistake, capsys):
    exercise_cases.refuses(_check(module), module.EXERCISES, question, wrong, mistake, capsys)


def test_the_answers_are_the_derivations():
    """Computed here from the chapter's formulas, not through the lab's own functions."""
    assert sp.EXERCISES["1"]() == pytest.approx(S * H * (34 / T + 5 * A * S / (H * T)) / MIB, rel=1e-12)
    assert sp.EXERCISES["2"]() == pytest.approx(4 * (T - 1) / T * M / MIB, rel=1e-12)
    assert cp.EXERCISES["3"]() == pytest.approx(2 * PEAK / IB, rel=1e-12)
    assert cp.EXERCISES["4"]() == pytest.approx(2 * PEAK / IB * 8 / 64, rel=1e-12)
    # cp = 8, a = 64: 4(cp-1)rho = 4(cp-1)(1 + rho)/cp at rho = 1/(cp - 1), above cp/a, so no copies
    assert Fraction(cp.EXERCISES["5"]()).limit_denominator(100) == Fraction(1, 7)


def test_two_significant_digits_of_exercise_5_are_accepted(capsys):
    """1/7 to two digits, 0.14, misses by 2 %: accepted; 0.15 (5 %) and 1/8 are not."""
    assert cp.check_answer("5", 0.14) and cp.check_answer(5, 0.143)
    assert not cp.check_answer("5", 0.15) and not cp.check_answer("5", 1 / 8)


def test_exercise_5_is_a_ratio_and_no_unit_slip_is_named(capsys):
    """8/64 = 1/8 is one mistake with two names, said once; 1/7 over GiB/GB, which the 3.5 %
    tolerance would match, is refused without a unit named; a factor 2 still is."""
    assert not cp.check_answer("5", 8 / 64)
    assert capsys.readouterr().out.count("1/8") == 1
    gib = 2**30 / 1e9
    for wrong in (1 / 7 / gib, 1 / 7 * gib, 0.1375):
        assert not cp.check_answer("5", wrong)
        out = capsys.readouterr().out
        assert "mixed up" not in out and "unit prefix" not in out, out
    assert not cp.check_answer("5", 2 / 7)
    assert "a factor 2 too many" in capsys.readouterr().out


def test_every_exercise_of_chapter_6_has_a_wrong_answer_tested():
    assert exercise_cases.untested(CASES, (sp, cp)) == set()
