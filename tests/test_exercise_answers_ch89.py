"""Chapters 8-9: each exercise checker accepts its computed answer and refuses the wrong answer a
source note or a careless reader gives. A checker that compared an answer with itself, or whose
tolerance swallowed the usual mistake, would fail here.

Each wrong answer is computed from the mistake it stands for, not typed in.
"""
import pytest

import exercise_cases

from labs.precision import loss_scaling as ls
from labs.recompute import policies as rc

H, A, S = 12288, 96, 2048   # the GPT-3 175B layer of chapter 9's exercises

CASES = [
    # chapter 8, mixed precision
    (ls, "1", 2.0 ** 0 / 2.0 ** -30, "lifting 2^-30 to 1.0 instead of to FP16's smallest normal"),
    (ls, "1", 2.0 ** -24 / 2.0 ** -30, "lifting 2^-30 to FP16's smallest subnormal, not its smallest normal"),
    (ls, "2", 2.0 ** -9 / (448 / 1792), "the whole smallest subnormal, not half of it"),
    (ls, "3", 8 * (2 ** 20 + 4), "N shards sent instead of N - 1"),
    # 4 bytes short of 7,340,060: inside a 1 % tolerance, so the checker must compare a count exactly
    (ls, "3", 7 * 2 ** 20, "the fp32 scales forgotten: one per shard"),
    (ls, "3", 7 * 2 ** 20 * 2, "the BF16 answer: two bytes per element"),
    (ls, "4", 2.0, "the exponent rounded up, which never saturates: not the rule"),
    (ls, "4", 9.0, "log2 of the amax, without subtracting E4M3's top exponent 8"),
    # chapter 9, recomputation and accumulation
    (rc, "1", (2 * A * S / H) / (32 + 2 * A * S / H),
     "the dropout-free count sbh(32 + 2as/h) for a layer with dropout"),
    (rc, "2", rc.selective_at_scale()["korthikanti_flops_added"] * 100,
     "about 2.7 %: the attention products counted again in backward (Korthikanti et al.'s Appendix A "
     "count), or backward's factor 2 left out of the denominator, 4hs/(24h^2 + 4hs), which lands "
     "within 0.4 % of it; the question asks for one extra forward of the two attention products "
     "over a whole step's FLOPs"),
    # backward's factor 2 forgotten: 4hs / (24h^2 + 4hs) at GPT-3's shape, the same message
    (rc, "2", 100 * 4 * H * S / (24 * H * H + 4 * H * S),
     "about 2.7 %: the attention products counted again in backward (Korthikanti et al.'s Appendix A "
     "count), or backward's factor 2 left out of the denominator, 4hs/(24h^2 + 4hs), which lands "
     "within 0.4 % of it; the question asks for one extra forward of the two attention products "
     "over a whole step's FLOPs"),
    (rc, "2", 100 / 3, "full recomputation's third"),
    (rc, "3", 1024 // 64, "the micro-batch of 2 left out: 1024 / dp"),
]


@pytest.mark.parametrize("module, question, wrong, mistake", CASES, ids=exercise_cases.ids(CASES))
def test_the_checker_refuses_the_usual_mistake(module, question, wrong, mistake, capsys):
    exercise_cases.refuses(module.check, module.EXERCISES, question, wrong, mistake, capsys)


def test_every_exercise_of_chapters_8_and_9_has_a_wrong_answer_tested():
    assert exercise_cases.untested(CASES, (ls, rc)) == set()
