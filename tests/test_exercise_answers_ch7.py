"""Chapter 7: each exercise checker accepts its computed answer and refuses the wrong answer a
source note or a careless reader gives. A checker that compared an answer with itself, or whose
tolerance swallowed the usual mistake, would fail here.

Each wrong answer is computed from the mistake it stands for, not typed in, and independently of
`moe_routing.WRONG` (the notebook's demonstration).
"""
import pytest

import exercise_cases

from labs.expert_parallel import moe_routing as mr

MIB = 2**20
BF16 = 4096 * 8 * 63 / 64 * 7168 * 2          # the dispatch of exercise 2, in bytes
P = mr.zipf_probs(8).tolist()

CASES = [
    ("1", 4096 / 64, "T/N = 64, without the capacity factor"),
    ("2", BF16 * 64 / 63 / MIB, "every row counted, the one that stays included"),
    ("2", BF16 / 1e6, "MB taken for MiB"),
    ("3", 8 * 7168 * 2, "k rows of h bf16 values, the flat dispatch's bound"),
    ("4", BF16 / 2 / MIB, "half of the bf16 bytes, the scales forgotten"),
    ("4", BF16 / MIB, "FP8 dispatch forgotten: the bf16 bytes"),
    # one byte per 128-element tile instead of 4: 0.8 % above the scales-forgotten answer
    ("4", 4096 * 8 * 63 / 64 * (7168 + 7168 // 128) / MIB,
     "one-byte UE8M0 scales (DeepEP's low-latency use_ue8m0), not fp32 ones"),
    ("5", 4 * P[0], "ep p_1, the second expert on the slowest rank forgotten"),
    ("5", 1.0, "uniform routing assumed: the slowest rank at the mean"),
    ("6", 2 * 31 / 32 * 8 * 50e6 * 2 / 1e9, "the ring over all 32 ranks instead of edp = 4"),
    ("6", 2 * 3 / 4 * 64 * 50e6 * 2 / 1e9, "every expert's gradient reduced, not the 64/ep = 8 a rank holds"),
]


@pytest.mark.parametrize("question, wrong, mistake", CASES,
                         ids=[f"ch7-{q}-{i}" for i, (q, _, _) in enumerate(CASES)])
def test_the_checker_refuses_the_usual_mistake(question, wrong, mistake, capsys):
    exercise_cases.refuses(mr.check, mr.EXERCISES, question, wrong, mistake, capsys)


def test_every_exercise_of_chapter_7_has_a_wrong_answer_tested():
    assert exercise_cases.untested([(mr, *case) for case in CASES], (mr,)) == set()
    assert set(mr.WRONG) == set(mr.EXERCISES)   # the notebook demonstrates a refusal for each too
