"""Chapter 17's exercises: the answers computed by the lab's own formulas, and the usual mistakes.

1. The tp group's bytes per rank and step (`layout3d.predict_bytes_per_group`) for a layout the
   chapter did not run: L = 12 layers on pp = 3 stages, tp = 8, m = 4 micro-batches of b = 2
   sequences of s = 16 tokens, h = 64, fp32.
2. ZeRO-1's bytes per rank and step in the dp group of a dp = 2 x cp = 2 layout whose rank holds
   P_local = 10,001 parameters: 2 (n - 1) ceil(P_local / n) elements, n = dp cp = 4.
3. How many times larger gamma_n (`rounding.gamma`) is in bf16 than in fp32 for an inner product of n = 128
   terms.
"""
import math

from labs import model as tiny
from labs.dims import ParallelDims
from labs.measure import exercises
from labs.threed import layout3d, rounding

FP32_U, BF16_U = 2.0 ** -24, 2.0 ** -8
# tp = 8, not 4: with tp = 4 = e, the bytes per element, two mistakes give one number; pp = 3, not 2:
# with pp = 2, all L layers (x pp) and any halving mistake (x 1/2) together give the right answer
EX1 = dict(layers=12, pp=3, tp=8, m=4, b=2, s=16, h=64)
EX2 = dict(params=10_001, dp=2, cp=2)
EX3_TERMS = 128


def tp_bytes(layers, pp, tp, m, b, s, h, elem=layout3d.FP32):
    """Exercise 1's answer from the lab's prediction, for a model of these shapes."""
    cfg = tiny.GPTConfig(vocab_size=64, seq_len=s, n_layer=layers, n_head=tp, hidden=h)
    return layout3d.predict_bytes_per_group(cfg, ParallelDims(tp=tp, pp=pp), b, m, s, stage=0,
                                            elem=elem)["tp"]


def zero1_bytes(params, n, elem=layout3d.FP32, padded=True):
    """ZeRO-1's reduce-scatter and all-gather over n ranks: 2 (n - 1) chunks of ceil(P / n).
    Unpadded, 2 (n - 1) P e / n: a count (an int, matched exactly) when n divides it."""
    if padded:
        return 2 * (n - 1) * math.ceil(params / n) * elem
    total = 2 * (n - 1) * params * elem
    return total // n if total % n == 0 else total / n


def gamma_ratio(n, u_low=BF16_U, u_high=FP32_U):
    return rounding.gamma(n, u_low) / rounding.gamma(n, u_high)


EXERCISES = {
    "1": lambda: tp_bytes(**EX1),                                            # bytes, int
    "2": lambda: zero1_bytes(EX2["params"], EX2["dp"] * EX2["cp"]),          # bytes, int
    "3": lambda: gamma_ratio(EX3_TERMS),                                     # a factor
}

MISTAKES = {
    # a quarter of the answer: four factors of 4 give it, all named
    "1": [(tp_bytes(**EX1, elem=1), "elements, not bytes: fp32's 4 bytes per element left out; or another "
           "factor 4 left out: the m = 4 micro-batches, the L/pp = 4 layers of a stage, or the four "
           "all-reduces per layer"),
          (tp_bytes(**EX1) // EX1["tp"], "the activation taken per tp rank, b s h / tp: under Megatron's "
           "tensor parallelism every rank all-reduces the whole b s h activation"),
          (tp_bytes(**{**EX1, "pp": 1}), "all L layers, not the L/pp of one stage"),
          # half the answer: two mistakes give it, both named
          (tp_bytes(**EX1) // 2, "the forward's two all-reduces (g) only, backward's two (f) left out; or "
           "the ring's factor 2 left out: an all-reduce sends (tp - 1)/tp of its buffer twice, once "
           "reducing and once gathering"),
          (tp_bytes(**EX1) * EX1["tp"] // (EX1["tp"] - 1),
           "each all-reduce as 2M: the ring's (tp - 1)/tp left out")],
    "2": [(zero1_bytes(EX2["params"], EX2["dp"]),
           "n = dp = 2: the cp ranks hold the same weights, so ZeRO-1 shards over dp x cp"),
          (zero1_bytes(EX2["params"], EX2["dp"] * EX2["cp"]) // 2,
           "the reduce-scatter only: the all-gather of the updated shards left out"),
          (zero1_bytes(EX2["params"], EX2["dp"] * EX2["cp"], elem=1),
           "elements, not bytes: fp32's 4 bytes per element left out"),
          (zero1_bytes(EX2["params"], EX2["dp"] * EX2["cp"], padded=False),
           "no padding: P_local / n per chunk, not ceil(P_local / n)")],
    "3": [(BF16_U / FP32_U, "the ratio of the unit roundoffs alone, 2^16: gamma_n's 1/(1 - n u) left out"),
          (gamma_ratio(EX3_TERMS - 1), "n = 127, one term short: n u = 127/256 in bf16, not 1/2"),
          (gamma_ratio(EX3_TERMS + 1), "n = 129, one term too many: n u = 129/256 in bf16, not 1/2")],
}
EX3_REL = 1e-5  # 131,072 for 131,071 passes (7.6e-6), 2 or more off does not; n = 127, 129 move it 0.8 %


def check(question, answer, rel=EX3_REL):
    """Automatic checker: bytes exactly, the factor within 0.001 % (2^17 = 131,072 passes; n = 127 or
    129 terms, 0.8 % off, does not, and is named); names the usual mistakes."""
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES)
