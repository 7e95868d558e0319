"""Chapters 12 and 13: each exercise checker accepts its computed answer and refuses the wrong
answer a source note or a careless reader gives. A checker that compared an answer with itself, or
whose tolerance swallowed the usual mistake, would fail here.

Each wrong answer is computed from the mistake it stands for, not typed in.
"""
import math

import pytest

import exercise_cases

from labs.checkpointing import checkpoint_cost as cost
from labs.failures import reliability as rel
from labs.memory_budget import budget

P70 = budget.MODELS["70B"].params()
PER_GPU = rel.llama3_per_gpu_mtbf_h()
JOB_16K = rel.job_mtbf(PER_GPU, rel.LLAMA3_GPUS)

CASES = [
    # chapter 12, checkpointing
    (cost, "1", cost.write_seconds(16 * P70, 10),
     "chapter 1's 16 bytes: gradients and bf16 weights saved too"),
    (cost, "1", cost.write_seconds(12 * P70, 10 / 8), "10 Gb/s read for 10 GB/s"),
    (cost, "1", cost.write_seconds(12 * 70e9, 10), budget.nominal_mistake("70B")),
    (cost, "2", math.ceil(10 / 4), "the padded shard's size, padding counted as written"),
    (cost, "3", 7 * 12, "samples consumed, not the position in the epoch"),
    (cost, "4", cost.lost_steps(8, 4, 0), "as if the save of step 8 had committed (a synchronous save)"),
    (cost, "4", max(cost.lost_steps(s, 4, 2) for s in range(4, 12)),
     "the worst case tau + omega - 1 (after step 9), not the loss after step 8"),
    # chapter 13, failures
    (rel, "1",
     rel.job_mtbf(rel.LLAMA3_DAYS * 24 / (rel.LLAMA3_UNEXPECTED + 47) * rel.LLAMA3_GPUS, 100_000) * 60,
     "the planned interruptions counted as failures too"),
    (rel, "1", PER_GPU * 60, "one GPU's MTBF: the 100,000 GPUs' rates not added"),
    (rel, "1", JOB_16K * 60, "the MTBF of Llama 3's 16,384-GPU job, not scaled to 100,000 GPUs"),
    (rel, "2", math.sqrt(1 / 60 * JOB_16K) * 60, "sqrt(delta M): Young's factor 2 left out"),
    (rel, "2", math.sqrt(2 * 1 * JOB_16K), "delta in minutes, M in hours"),
    (rel, "2", rel.daly(1 / 60, JOB_16K) * 60, "Daly's interval, not Young's"),
    (rel, "2", rel.young(1 / 60, rel.job_mtbf(PER_GPU, 16_000)) * 60, "16,000 GPUs for 16,384"),
]


@pytest.mark.parametrize("question", sorted(rel.EXERCISES))
def test_chapter_13_accepts_the_printed_rounding_of_its_answers(question):
    """The page prints each answer to 0.1 minute; that rounding must pass the tolerance."""
    answer = rel.EXERCISES[question]()
    assert rel.check(question, round(answer, 1))


@pytest.mark.parametrize("module, question, wrong, mistake", CASES, ids=exercise_cases.ids(CASES))
def test_the_checker_refuses_the_usual_mistake(module, question, wrong, mistake, capsys):
    exercise_cases.refuses(module.check, module.EXERCISES, question, wrong, mistake, capsys)


def test_every_exercise_of_chapters_12_and_13_has_a_wrong_answer_tested():
    assert exercise_cases.untested(CASES, (cost, rel)) == set()
