"""Chapter 14: the planner against published runs, each with its primary source.

- Narayanan et al. 2021 (arXiv 2104.04473), §5.1, Table 1: ten GPT models on Selene's A100s, all
  with the interleaved schedule, the scatter/gather optimization and activation recomputation
  (eq. 3 "assumes activation recomputation"); TFLOP/s per GPU by eq. 3, which counts the
  recomputed forward.
- Llama Team 2024 (arXiv 2407.21783), §3.3.2, Table 4: Llama 3 405B on 8,192 and 16,384 H100s,
  trained at 8K "without activation checkpointing", FSDP keeping the gathered weights through
  backward and reducing gradients in fp32; TFLOP/s as BF16 MFU x peak (PaLM's count, Chowdhery
  et al. 2022). The 131,072-token row prints DP = 4 before arXiv v3 (v3 prints 8), which with TP 8,
  CP 16 and PP 16 fills 8,192 GPUs, not the 16,384 printed beside it, and gives 8M tokens, not 16M;
  DP = 8 fits both (chapters 1 and 2 flag the same row), and the planner uses it.
- DeepSeek-AI 2024 (arXiv 2412.19437), §3.2 and §4.2: DeepSeek-V3 on 2,048 H800s, PP 16, EP 64
  over 8 nodes, ZeRO-1 DP, no TP, batch 15,360 sequences of 4,096; it prints no TFLOP/s, only
  180K H800 GPU hours per trillion tokens (§1), from which the figure here is derived (not published)
  with PaLM's count of its active parameters, MTP module left out (`flop_count` shows the terms).
- The source notes' own questions: 70B on one node of 8 H100s, 405B on 16,384 H100s.

The calibration (one efficiency constant per GPU generation and precision) and the other published
runs are in `checked`; every row here but the A100's calibration row is a prediction.
"""
import dataclasses
from dataclasses import dataclass, field

from labs.dims import ParallelDims
from labs.memory_budget import compute
from labs.formulas.planning import planner, shapes, software, timing

# Narayanan et al. 2021, Table 1, as printed: billions of parameters, heads, hidden, layers, TP, PP,
# GPUs, batch (sequences), TFLOP/s per GPU, % of peak, aggregate PFLOP/s.
MEGATRON_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
)
# Table 4 prints MFU, not the FLOP count it divides by: PaLM's count with full (non-causal) attention is
# assumed, as for the 8K rows; `scorecard.explain` prints the error under the causal count (half the
# attention's FLOPs, `published_counts.palm(causal=True)`) beside it
LLAMA3_CAUSAL_NOTE = "FLOPs counted as PaLM's, non-causal attention (assumed: Table 4 does not say)"
DEEPSEEK_GPU_HOURS_PER_T_TOKENS = 180e3     # §1 and §4.4.2
DEEPSEEK_BATCH = 15_360                      # sequences, after the ramp (§4.2)


@dataclass
class Case:
    name: str
    source: str
    job: planner.Job
    published: ParallelDims  # the layout the source states
    fixed: dict = field(default_factory=dict)   # settings the source states
    tflops: float = None     # published TFLOP/s per GPU (None: the source gives none)
    counted: str = "none"    # the recomputation the source's FLOP count includes
    flops_per_token: float = None   # the source's own count, when it is not PaLM's (+ ``counted``)
    memory_gib: float = None        # published peak memory per GPU
    notes: str = ""
    recompute_words: str = None     # the source's own words for its recomputation, where it states them

    def per_token(self):
        """The FLOPs per token the published TFLOP/s divides by."""
        return self.flops_per_token or timing.model_flops_per_token(self.job.model, self.counted)


def megatron_cases():
    out = []
    for b, a, h, L, tp, pp, gpus, batch, tflops, pct, agg in MEGATRON_TABLE1:
        model = shapes.gpt(f"GPT {b}B", L, h, a)
        # Megatron-LM in 2021: no sequence parallelism (Korthikanti et al. 2022 added it), no
        # distributed optimizer; scores written out, then softmax (§4.2); every run recomputes (eq. 3)
        job = planner.Job(model, shapes.SELENE, gpus, batch * model.seq, software.MEGATRON_2021)
        fixed = {}
        out.append(Case(f"GPT {b}B", "Narayanan et al. 2021, Table 1", job,
                        ParallelDims(tp=tp, pp=pp, dp=gpus // (tp * pp)), fixed, tflops, "full"))
    return out


def llama3_cases():
    out = []
    for r in compute.LLAMA3_405B_TABLE4:
        dp = r["gpus"] // (r["tp"] * r["cp"] * r["pp"])       # 8 on the long-context row (see above)
        model = dataclasses.replace(shapes.LLAMA3_405B, seq=r["seq"])
        # FSDP keeping the gathered weights through backward, fp32 gradients: ZeRO-2 (software.LLAMA3);
        # at 8K "without activation checkpointing"
        stack = software.LLAMA3.with_(recompute=("none",)) if r["seq"] <= 8192 else software.LLAMA3
        job = planner.Job(model, shapes.LLAMA3_CLUSTER, r["gpus"], compute.LLAMA3_TOKENS_PER_BATCH, stack)
        # §3.3.2: "the first model chunk on the first stage has only the embedding, and the last model
        # chunk on the last stage has only output projection and loss": 126 = 16 x 8 - 2 layers, v = 8
        fixed = {"v": 8}
        # which FLOP count Table 4's MFU divides by is not printed; PaLM's (full attention) is assumed. At
        # 131K the attention is most of it, and a causal count (`LLAMA3_CAUSAL_NOTE`) moves the error far
        notes = LLAMA3_CAUSAL_NOTE if r["seq"] > 8192 else ""
        out.append(Case(f"Llama 3 405B, {r['gpus']:,} GPUs, s = {r['seq']:,}", "Llama Team 2024, Table 4",
                        job,
                        ParallelDims(tp=r["tp"], pp=r["pp"], cp=r["cp"], dp=dp), fixed, r["tflops"],
                        notes=notes))
    return out


def deepseek_case():
    model = shapes.DEEPSEEK_V3
    tokens_per_gpu_s = 1e12 / (DEEPSEEK_GPU_HOURS_PER_T_TOKENS * 3600)
    tflops = tokens_per_gpu_s * timing.model_flops_per_token(model) / 1e12
    # ZeRO-1 as §3.2 states; FP8 matmuls (§3.3)
    job = planner.Job(model, shapes.H800_CLUSTER, 2048, DEEPSEEK_BATCH * model.seq, software.HAI_LLM, "fp8")
    return Case("DeepSeek-V3, 2,048 H800s", "DeepSeek-AI 2024, §3.2, §4.2 (TFLOP/s from §1's GPU hours)", job,
                ParallelDims(pp=16, ep=64, dp=128), {"zero": 1}, tflops)


def notes_cases():
    """Source 001's quiz, questions 1 and 2, with the plans the note proposes."""
    m70 = shapes.LLAMA2_70B
    q1 = planner.Job(m70, shapes.DGX_H100, 8, 1024 * m70.seq)   # a 4M-token batch
    q2 = planner.Job(shapes.LLAMA3_405B, shapes.DGX_H100, 16_384, compute.LLAMA3_TOKENS_PER_BATCH)
    return [Case("70B on one node of 8 H100s", "source 001, quiz 1: ZeRO-3 over 8", q1,
                 ParallelDims(dp=8), {"zero": 3}),
            Case("405B on 16,384 H100s", "source 001, quiz 2: TP 8, PP 16, DP 128, ZeRO-1", q2,
                 ParallelDims(tp=8, pp=16, dp=128), {"zero": 1, "recompute": "selective"})]


def evaluate(case, eta, result=None):
    """The planner on the case's job (``result``, if already run), and the published layout's
    verdict (fits by the planner's count, or the term that overflows), its rank among the layouts
    that fit, and its estimated TFLOP/s per GPU against the published figure.

    Two ranks: ``rank``, where the published degrees stand in the planner's own list, every layout
    (the published one too) at the fastest setting its stack offers (or at its stated settings, where
    they fit and are faster, or lie outside what the planner searches), the planner's definition of a
    layout's rank; none for a row the planner would refuse (`planner.rank_of`); ``rank_stated``,
    the published layout at the settings its source states (the TFLOP/s estimate's) against the others at
    their fastest, which also counts a setting the source chose slower than the planner's (recomputation it
    did not need, by the count)."""
    result = result or planner.plan(case.job, eta)
    row = planner.published(case.job, case.published, eta, case.fixed)
    listed = next((r for r in result["ranked"] if r["dims"] == case.published), row)
    if row["fits"] and row["time"]["step"] < listed["time"]["step"]:
        listed = row
    out = {"case": case, "result": result, "row": row, "fits": row["fits"], "of": len(result["ranked"]),
           "best": result["ranked"][:3], "rank": None, "rank_stated": None, "estimate": None, "error": None,
           "listed": listed}
    out["estimate"] = tflops(case, row)
    # a rank only for a row the planner would admit: no rule broken, its count within the GPU
    if result["ranked"] and listed.get("fits", True):
        out["rank"] = planner.rank_of(result, listed)
    if result["ranked"] and row["fits"]:
        out["rank_stated"] = planner.rank_of(result, row)
    if case.tflops:
        out["error"] = out["estimate"] / case.tflops - 1
    return out


def tflops(case, row):
    """Estimated TFLOP/s per GPU of a row of the case's job, by the source's own FLOP count."""
    return case.per_token() * case.job.batch_tokens / row["time"]["step"] / case.job.gpus / 1e12


def estimate(case, eta):
    """The estimated TFLOP/s per GPU of the case's published layout alone (no enumeration)."""
    return tflops(case, planner.published(case.job, case.published, eta, case.fixed))


def calibrate(case, lo=0.05, hi=1.0, steps=30):
    """eta at which the estimate of ``case`` equals its published TFLOP/s (bisection: the estimate
    grows with eta)."""
    if estimate(case, hi) < case.tflops:
        raise ValueError(f"{case.name}: even eta = {hi} estimates less than the published {case.tflops} "
                         "TFLOP/s.")
    for _ in range(steps):   # 30 halvings of 0.95: eta to 1e-9, far below any figure shown
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if estimate(case, mid) < case.tflops else (lo, mid)
    return (lo + hi) / 2


def all_cases():
    return megatron_cases() + llama3_cases() + [deepseek_case()] + notes_cases()
