"""Chapters 10-11: each exercise checker accepts its computed answer and refuses the wrong answer a
source note or a careless reader gives. A checker that compared an answer with itself, or whose
tolerance swallowed the usual mistake, would fail here.

Each wrong answer is computed from the mistake it stands for, not typed in.
"""
from types import SimpleNamespace

import pytest

import exercise_cases

from labs.collectives import toolkit as col
from labs.hardware import placement as P
from labs.pipeline.stage_balance import stage_layers

M1, M2 = 2 ** 30, 2 ** 20           # the buffers of exercises 10.1 and 10.2
ALPHA, INV_BETA = 5e-6, 25e9        # exercise 10.3: 5 us, 25 GB/s, 16 ranks
SPLIT = [len(layers) for layers in stage_layers(P.LLAMA3_405B.layers, 16)]


# each chapter's checker under the (EXERCISES, check) names chapters 1-5 use
Chapter10 = SimpleNamespace(__name__=col.__name__, EXERCISES=col.EXERCISES, check=col.check_answer,
                            MISTAKES=col.MISTAKES)
Chapter11 = SimpleNamespace(__name__=P.__name__, EXERCISES=P.ANSWERS, check=P.check, MISTAKES=P.MISTAKES)


CASES = [
    # chapter 10, the collectives toolkit
    (Chapter10, "1", M1, "the payload M for what the ring sends, 2(N-1)/N M"),
    (Chapter10, "1", 2 * M1, "2M: the ring's (N-1)/N left out"),
    (Chapter10, "1", 2 * 7 / 8 * 1e9, "GB for GiB: M is 2^30 bytes, not 10^9"),
    (Chapter10, "2", col.formula("all_reduce", "ring", 8, M2)[1],
     "the ring's 2(N-1)/N M for doubling's M lg N"),
    (Chapter10, "2", M2, "one swap of M: the lg N rounds left out"),
    (Chapter10, "3", 26 * ALPHA * INV_BETA,
     "the rounds saved times alpha/beta, without the bytes' lg N - 2(N-1)/N"),
    (Chapter10, "3", (16 - 1 - 4) * ALPHA * INV_BETA / (4 - 2 * 15 / 16),
     "the ring's N-1 rounds (one half) for its 2(N-1)"),
    # chapter 11, hardware and placement
    (Chapter11, "11.1", P.ANSWERS["11.1"]() * (P.LLAMA3_405B.layers // 16) / max(SPLIT),
     f"{P.LLAMA3_405B.layers} // 16 layers on every stage"),
    (Chapter11, "11.1", P.ANSWERS["11.1"]() * (P.LLAMA3_405B.layers / 16) / max(SPLIT),
     f"{P.LLAMA3_405B.layers} / 16 layers on every stage: the first and last stages' lighter load ignored"),
    (Chapter11, "11.1", P.ANSWERS["11.1"]() * 8 / 7, "2M per all-reduce: the ring's (N-1)/N left out"),
    (Chapter11, "11.2", P.ANSWERS["11.2"]() * P.NDR_IB_BPS / P.NVLINK4_BPS,
     "the NVLink time, not the network's"),
    (Chapter11, "11.2", P.ANSWERS["11.2"]() / 8, "400 Gb/s read as 400 GB/s"),
    # NCCL's 46 to 48 GB/s per NDR port (the page's table) for the 50 GB/s line rate; at 48 GB/s the
    # answer is 4.2 % high, within 1 % of a MiB/MB slip (4.9 %), which must not claim it
    *[(Chapter11, "11.2", P.ANSWERS["11.2"]() * 50e9 / effective,
       "NCCL's effective bandwidth used instead of the line rate") for effective in (48e9, 46e9)],
    (Chapter11, "11.3", 0, "Delta N <= G_node taken as enough: every CP group has fewer ranks than a node"),
    (Chapter11, "11.3", 6, "the groups that stay inside one node, not those that cross"),
    (Chapter11, "11.4", 2 * (16 - 1), "v = 1: the 8 chunks per rank left out"),
    (Chapter11, "11.4", 16 * 8 - 1, "the forward crossings only"),
    (Chapter11, "11.4", 2 * 8 * 16,
     "2 v m, all of a rank's sends, or 2 p v, p v boundaries: the chain has p v - 1 each way"),
]


@pytest.mark.parametrize("module, question, wrong, mistake", CASES, ids=exercise_cases.ids(CASES))
def test_the_checker_refuses_the_usual_mistake(module, question, wrong, mistake, capsys):
    exercise_cases.refuses(module.check, module.EXERCISES, question, wrong, mistake, capsys)


def test_every_exercise_of_chapters_10_and_11_has_a_wrong_answer_tested():
    assert exercise_cases.untested(CASES, (Chapter10, Chapter11)) == set()

