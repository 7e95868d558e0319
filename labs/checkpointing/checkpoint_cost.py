"""Chapter 12: what a checkpoint weighs and how long writing it stops training, from chapter 1's sizes.

A checkpoint must hold what cannot be recomputed: under the mixed-precision recipe of chapter 1
that is the fp32 master weights and Adam's two moments, 12 bytes per parameter (the bf16 working
weights are a rounding of the master, and gradients are rebuilt by the next step). Written
synchronously at an aggregate bandwidth W, a checkpoint of M bytes stops training for M / W.
Every bandwidth here is an input, named where it is used; none was measured on real storage.
"""
import math

from labs.memory_budget import budget, recipes
from labs.measure import exercises

GB = 1e9


def checkpoint_bytes(model="70B", recipe="mixed", with_working_weights=False):
    """Bytes of one full checkpoint: optimizer state (master + m + v), optionally the bf16 weights."""
    per = recipes.recipe(recipe).bytes_per_param()
    per_param = per["optimizer_state"] + (per["parameters"] if with_working_weights else 0)
    return per_param * budget.MODELS[model].params()


def write_seconds(nbytes, gb_per_s):
    """Seconds to write ``nbytes`` at an aggregate ``gb_per_s`` (10^9 bytes per second)."""
    if gb_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {gb_per_s}; pass GB/s, e.g. 10.")
    return nbytes / (gb_per_s * GB)


def implied_bandwidth(nbytes, seconds):
    """The aggregate GB/s at which writing ``nbytes`` takes ``seconds``."""
    return nbytes / seconds / GB


def per_gpu_bytes(model, gpus, recipe="mixed"):
    """The average checkpoint bytes per GPU when ``gpus`` GPUs hold the state without replicas."""
    return checkpoint_bytes(model, recipe) / gpus


def whole_checkpoint(model="405B", gpus=16_384, replicas=1, with_working_weights=False):
    """Bytes of one checkpoint summed over every GPU that writes: the optimizer state once when it is
    sharded over all ``gpus`` (FSDP, as Llama 3 shards optimizer states, §3.3.2), ``replicas`` times
    when each of that many data-parallel replicas writes its own copy; and the average per GPU."""
    total = replicas * checkpoint_bytes(model, with_working_weights=with_working_weights)
    return {"total_bytes": total, "per_gpu_bytes": total / gpus, "gpus": gpus, "replicas": replicas}


def shard_range(numel, world_size, rank):
    """[start, end) of the real elements rank ``rank`` writes of a flat tensor padded to world_size."""
    shard = math.ceil(numel / world_size)
    return min(rank * shard, numel), min((rank + 1) * shard, numel)


def lost_steps(s, tau, omega):
    """Steps a job loses when it dies after step ``s``, saving every ``tau`` steps with each save
    committed ``omega`` steps after it starts (0: synchronous); no checkpoint before step ``tau``."""
    if s < tau:
        return s
    return s % tau + (tau if s % tau < omega else 0)


# Chapter 12's exercises: the answers are computed here, so the book never types them.
EXERCISES = {
    "1": lambda: write_seconds(checkpoint_bytes("70B"), 10),          # sync write at 10 GB/s, seconds
    "2": lambda: (lambda r: r[1] - r[0])(shard_range(10, 4, 3)),       # elements rank 3 of 4 writes
    "3": lambda: (7 * 12) % 60,                                       # loader position in its epoch
    "4": lambda: lost_steps(8, 4, 2),                                 # steps lost, async save in flight
}

# The answer a careless reader gives to each, which the checker must refuse
# (tests/test_exercise_answers_ch1213.py
# tests these and more).
WRONG = {
    # chapter 1's 16 bytes, gradients and bf16 weights kept
    "1": write_seconds(16 * budget.MODELS["70B"].params(), 10),
    "2": 3,                                                      # the padded shard's size
    # samples consumed, not the position in the epoch
    "3": 7 * 12,
    "4": 8 % 4,                                                  # as if the save of step 8 had committed
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "1": [(WRONG["1"], "chapter 1's 16 bytes: gradients and bf16 weights saved too"),
          (lambda: write_seconds(checkpoint_bytes("70B"), 10 / 8), "10 Gb/s read for 10 GB/s"),
          budget.nominal("70B", EXERCISES["1"])],
    "2": [(WRONG["2"], "the padded shard's size, padding counted as written")],
    "3": [(WRONG["3"], "samples consumed, not the position in the epoch")],
    "4": [(WRONG["4"], "as if the save of step 8 had committed (a synchronous save)"),
          (4 + 2 - 1, "the worst case tau + omega - 1 (after step 9), not the loss after step 8")],
}


def check(question, answer, rel=0.01):
    """Automatic checker: within 1% of the computed answer."""
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES)
