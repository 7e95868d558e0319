"""Chapter 5's worked problems: each answer computed by the bubble formulas (`labs.formulas.schedules`),
the answers the usual mistakes give, and the checker (`labs.measure.exercises`), so the book never
types an answer."""

from labs.formulas.schedules import formula, microbatches_for, microbatches_to_halve
from labs.measure import exercises


# Chapter 5's exercises: the answers are computed here, so the book never types them.
EXERCISES = {
    "1": lambda: formula("1f1b", 16, 48)["over_total"],
    "2": lambda: microbatches_for(16, 0.05),
    "3": lambda: formula("interleaved", 8, 32, 4)["over_ideal"],
    "4": lambda: microbatches_to_halve(4, 12),                    # an exact count of micro-batches
}


# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "1": [(lambda: formula("1f1b", 16, 48)["over_ideal"],
           "(p-1)/m: the bubble over the ideal time, not the total"),
          (lambda: 16 / (48 + 16), "p/(m+p): p idle slots counted instead of p - 1")],
    "2": [(lambda: next(m for m in range(1, 1000) if 15 / m <= 0.05),
           "(p-1)/m <= 5 %: the bubble over the ideal time, not the total")],
    "3": [(lambda: formula("1f1b", 8, 32)["over_ideal"], "the interleaving's v = 4 left out"),
          (lambda: formula("interleaved", 8, 32, 4)["over_total"],
           "the bubble over the total time, not over the ideal")],
    "4": [(lambda: 2 * 12, "doubling m: the p - 1 idle slots stay, so the share falls to 1/9, not 1/10")],
}


# Every answer is a ratio or a count: a GiB/GB, MiB/MB or bit/byte slip means nothing here, a factor 2 does.
SLIPS = [(ratio, what) for ratio, what in exercises.SLIPS if ratio in (2.0, 0.5)]


def check(question, answer, rel=0.01):
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES, slips=SLIPS)
