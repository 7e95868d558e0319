"""Chapter 3: the per-rank formulas of the ZeRO stages, and the chapter's exercises with their checker.

`formula_bytes` and `formula_comm` are the ZeRO paper's bytes held and sent per rank; `stages`
measures the lab against them and re-exports all of this module. `check` is `exercises.checker` over
the chapter's answers and the usual mistakes, each computed from the mistake.
"""
from labs.formulas import costs
from labs.measure import exercises
from labs.memory_budget import budget

BF16 = 2


def formula_bytes(stage, padded, n):
    """Chapter 1's per-rank formulas, on the padded element count."""
    per_param = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]
    return per_param * padded


def formula_comm(stage, padded, n, zero1_allreduce=False):
    """Bytes each rank sends per step: {2, 2, 2, 3} passes of (N-1)/N x Psi x 2 bytes (`measure.costs`)."""
    passes = 3 if stage == 3 or (stage == 1 and zero1_allreduce) else 2
    return passes * costs.sent("all_gather", padded * BF16, n)


# Chapter 3's exercises, and the answers the usual mistakes give (the checker names them), computed here.
EXERCISES = {"1": lambda: budget.state_gb("70B", 64, zero_stage=2),
             "2": lambda: formula_comm(3, budget.MODELS["13B"].params(), 8) / budget.GB,
             "3": lambda: budget.lowest_zero_stage("13B", 8, 0.1, seq=4096, micro_batch=8, recompute="full")}
MISTAKES = {"1": [(lambda: budget.state_gb("70B", 64, 2, "bf16_no_master"),
                   "2 + 10/N bytes per parameter: the 12-byte recipe, without the fp32 master copy"),
                  (lambda: budget.state_gb("70B", 64, 1), "ZeRO-1's 4 + 12/N: the gradients left whole"),
                  (lambda: (2 + 16 / 64) * budget.MODELS["70B"].params() / budget.GB,
                   "2 + 16/N: the bf16 weights counted twice, kept whole and again in ZeRO-3's 16/N"),
                  (lambda: (2 + 14 / 63) * budget.MODELS["70B"].params() / budget.GB,
                   "N - 1 for N: the 14 bytes divided over 63 ranks, not 64"),
                  budget.nominal("70B", EXERCISES["1"])],
            "2": [(lambda: formula_comm(0, budget.MODELS["13B"].params(), 8) / budget.GB,
                   "DDP's bytes: ZeRO-3's extra all-gather left out"), budget.nominal("13B", EXERCISES["2"])],
            "3": [(lambda: budget.lowest_zero_stage("13B", 8, 0.0, seq=4096, micro_batch=8, recompute="full"),
                   "stage 1: it fits in 80 GiB, but with no room for buffers, logits and fragmentation")]}
# the named mistakes are tested before the tolerance (`exercises.verdict`), so a mistake that lands
# within 1 % of the answer (13e9 for Psi = 13.016e9, 0.12 % off) is named, not accepted
check = exercises.checker(EXERCISES, MISTAKES)
