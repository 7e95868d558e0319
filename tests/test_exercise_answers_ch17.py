"""Chapter 17: each exercise checker accepts its computed answer and refuses the wrong answer a
careless reader gives. A checker that compared an answer with itself, or whose tolerance swallowed
the usual mistake, would fail here.

Each wrong answer is computed from the mistake it stands for, not typed in.
"""
import math

import pytest

import exercise_cases

from labs.threed import problems as p17

# exercise 1: L = 12, pp = 3, tp = 8, m = 4, b = 2, s = 16, h = 64, fp32
M1 = 2 * 16 * 64                                    # elements of one (b, s, h) activation
RING = 2 * (8 - 1) / 8                              # a ring all-reduce's factor over tp = 8
P2, N2 = 10_001, 2 * 2                              # exercise 2: P_local, n = dp x cp

QUARTER = ("elements, not bytes: fp32's 4 bytes per element left out; or another factor 4 left out: the "
           "m = 4 micro-batches, the L/pp = 4 layers of a stage, or the four all-reduces per layer")
HALF = ("the forward's two all-reduces (g) only, backward's two (f) left out; or the ring's factor 2 left "
        "out: an all-reduce sends (tp - 1)/tp of its buffer twice, once reducing and once gathering")
CASES = [
    (p17, "1", int(12 / 3 * 4 * 4 * RING * M1), QUARTER),
    # the same number: one micro-batch (m = 4 left out); all four factors are named
    (p17, "1", int(12 / 3 * 1 * 4 * RING * M1 * 4), QUARTER),
    (p17, "1", int(12 / 3 * 4 * 4 * RING * (M1 / 8) * 4),
     "the activation taken per tp rank, b s h / tp: under Megatron's tensor parallelism every rank "
     "all-reduces the whole b s h activation"),
    (p17, "1", int(12 * 4 * 4 * RING * M1 * 4), "all L layers, not the L/pp of one stage"),
    (p17, "1", int(12 / 3 * 4 * 2 * RING * M1 * 4), HALF),
    # the same number: each all-reduce as (tp - 1)/tp M, the ring's factor 2 dropped; both named
    (p17, "1", int(12 / 3 * 4 * 4 * RING / 2 * M1 * 4), HALF),
    (p17, "1", int(12 / 3 * 4 * 4 * 2 * M1 * 4), "each all-reduce as 2M: the ring's (tp - 1)/tp left out"),
    (p17, "2", 2 * (2 - 1) * math.ceil(P2 / 2) * 4,
     "n = dp = 2: the cp ranks hold the same weights, so ZeRO-1 shards over dp x cp"),
    (p17, "2", (N2 - 1) * math.ceil(P2 / N2) * 4,
     "the reduce-scatter only: the all-gather of the updated shards left out"),
    (p17, "2", 2 * (N2 - 1) * math.ceil(P2 / N2), "elements, not bytes: fp32's 4 bytes per element left out"),
    (p17, "2", 2 * (N2 - 1) * P2 / N2 * 4, "no padding: P_local / n per chunk, not ceil(P_local / n)"),
    (p17, "3", 2.0 ** 16, "the ratio of the unit roundoffs alone, 2^16: gamma_n's 1/(1 - n u) left out"),
    # n off by one: 0.8 % off, inside a 1 % band; refused and named (the band is 0.001 %)
    (p17, "3", (127 / 256 / (1 - 127 / 256)) / (127 * 2.0 ** -24 / (1 - 127 * 2.0 ** -24)),
     "n = 127, one term short: n u = 127/256 in bf16, not 1/2"),
    (p17, "3", (129 / 256 / (1 - 129 / 256)) / (129 * 2.0 ** -24 / (1 - 129 * 2.0 ** -24)),
     "n = 129, one term too many: n u = 129/256 in bf16, not 1/2"),
    (p17, "3", 2 * (0.5 / (1 - 0.5)) / (128 * 2.0 ** -24 / (1 - 128 * 2.0 ** -24)), "a factor 2 too many"),
]


def test_the_answers_are_the_formulas_by_hand():
    assert p17.EXERCISES["1"]() == 12 // 3 * 4 * 4 * 14 // 8 * M1 * 4
    assert p17.EXERCISES["2"]() == 2 * 3 * 2501 * 4
    n_u = 128 * 2.0 ** -8                           # 1/2: gamma_128 = 1 in bf16
    n_u32 = 128 * 2.0 ** -24
    assert p17.EXERCISES["3"]() == pytest.approx((n_u / (1 - n_u)) / (n_u32 / (1 - n_u32)))


@pytest.mark.parametrize("module, question, wrong, mistake", CASES, ids=exercise_cases.ids(CASES))
def test_the_checker_refuses_the_usual_mistake(module, question, wrong, mistake, capsys):
    exercise_cases.refuses(module.check, module.EXERCISES, question, wrong, mistake, capsys)


def test_exercise_2s_mistakes_are_counts_matched_exactly(capsys):
    """No padding gives 60,006 bytes, an exact count: a wrong answer near it (60,000) is not told it
    forgot the padding, and the no-padding answer itself is."""
    unpadded = p17.MISTAKES["2"][3][0]
    assert unpadded == 2 * (N2 - 1) * P2 * 4 // N2 and isinstance(unpadded, int)
    assert not p17.check("2", 60_000)
    assert "padding" not in capsys.readouterr().out
    assert not p17.check("2", unpadded)
    assert "no padding" in capsys.readouterr().out


def test_exercise_3_accepts_about_2_17_and_the_band_is_narrower_than_n_off_by_one(capsys):
    """2^17 = 131,072 is the answer to 8 parts in a million; n = 127 or 129 is 0.8 % off."""
    assert p17.check("3", 2 ** 17)
    assert not p17.check("3", 131080) and not p17.check("3", 131073)   # a few off: outside the band
    near = p17.EXERCISES["3"]() * (1 - 0.005)         # 0.5 % off: no mistake, outside the band
    assert not p17.check("3", near)
    assert "n = 12" not in capsys.readouterr().out


def test_every_exercise_of_chapter_17_has_a_wrong_answer_tested():
    assert exercise_cases.untested(CASES, (p17,)) == set()


def test_exercise_1s_two_mistakes_do_not_cancel():
    # with pp = 2, all L layers (x pp) with the forward's all-reduces only (x 1/2) gave the answer
    right = p17.EXERCISES["1"]()
    both = right * 3 // 2                      # all L layers (x 3) and forward only (x 1/2)
    assert both != right and not p17.check("1", both)
