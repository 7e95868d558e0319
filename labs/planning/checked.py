"""Chapter 14: the checked set. Every published run (`cases`' 14 rows and `published_runs`' 98) as a
planner job, the calibration, and the planner's verdict on each row.

A row becomes a `cases.Case`: its model, its cluster (by the GPU it names), the stack that ran it
(`software`, with the overlaps the source states), the precision of its matmuls, the settings the
source states (`fixed`), and the FLOP count its TFLOP/s divide by (from its own tokens per second
where it prints them, so the comparison is one of tokens per second). Nothing is tuned per row.

Calibration (`CALIBRATION`): one efficiency constant eta per GPU generation and matmul precision,
fitted by bisection on one stated row so that the estimate for that row's published layout equals its
published TFLOP/s. The rule that picks the row: the GPT-3 width (h = 12,288) where the generation has
one (A100: Narayanan et al. 2021, Table 1; H100 BF16: Megatron-LM's H100 table; H100 FP8: NeMo
24.07's GPT3-175B); torchtitan's GPUs (H100 96GB HBM2e at 500 W, whose peak its page says it does not
know) are their own generation, fitted on the 70B vanilla-TP rows of its async-TP page, its largest
model at plain settings, BF16 and FP8. The H800 shares the H100's constants (the same chip). Every
other row is a prediction.
"""
import dataclasses
import functools

from labs.dims import ParallelDims
from labs.formulas.planning import planner, shapes, software as sw
from labs.planning import cases, published_counts, published_runs

CLUSTERS = {"A100 80GB": shapes.SELENE, "H100 80GB": shapes.DGX_H100, "H800 80GB": shapes.H800_CLUSTER,
            "H100 96GB HBM2e, 500 W": shapes.GRAND_TETON}
CALIBRATION = {("A100", "bf16"): "GPT 145.6B",
               ("H100", "bf16"): "Megatron-LM H100, GPT 177B",
               ("H100", "fp8"): "NeMo 24.07 GPT3-175B, 128 GPUs",
               ("H100 96GB 500W", "bf16"): "torchtitan 70B FSDP 32 TP 8, bf16, vanilla TP",
               ("H100 96GB 500W", "fp8"): "torchtitan 70B FSDP 32 TP 8, fp8 tensorwise, vanilla TP"}
# DeepSeek-V2 prints no GPU count: 1,024 assumed (DP 64 with PP 16), which moves only its DP traffic
DEEPSEEK_V2_GPUS = 1024
# Megatron-Core's module recompute: norms and the activation function rerun: only the SwiGLU's
# products go, about what a fused SwiGLU saves (`fused_swiglu`), so "none" under fused kernels;
# "layernorm, moe": the MoE block rerun from its input ("mlp")
RECOMPUTE = {None: None, "none": "none", "selective": "selective", "full": "full", "norm, act": "none",
             "selective (per op)": "selective_ops", "selective (layernorm, moe)": "mlp"}


def stack(run):
    """The `software.Software` that ran ``run``, with the overlaps its source states."""
    f = run.framework
    if f.startswith("Megatron-Core r0.8.0"):
        return sw.MEGATRON_CORE
    if f == "Megatron-LM" and run.name.startswith("Korthikanti"):
        return sw.MEGATRON_2022.with_(sp=run.recompute == "selective")
    if f == "Megatron-LM" and run.name.startswith("Nemotron"):
        return sw.NEMOTRON
    if f == "Megatron-LM":
        return sw.MEGATRON_2021
    if f.startswith("DeepSpeed ZeRO-3"):
        return sw.DEEPSPEED_ZERO3
    if f.startswith("Megatron-DeepSpeed"):
        return sw.MEGATRON_DEEPSPEED
    if f.startswith("metaseq"):
        return sw.METASEQ
    if f == "HAI-LLM":
        return sw.HAI_LLM
    if f.startswith("MegaScale"):
        return sw.MEGASCALE
    if f.startswith("Megatron-LM 285068c8"):
        return sw.MEGASCALE_BASELINE
    if f.startswith("torchtitan"):
        base = sw.TORCHTITAN if f.startswith("torchtitan 9dec370") else sw.TORCHTITAN_2025
        return base.with_(tp_overlap="AsyncTP" in run.name or "async TP" in run.name)
    if f.startswith("NeMo 25.11"):
        return sw.NEMO_2511
    if f.startswith("NeMo"):
        return sw.NEMO
    if f.startswith("Megatron-Core ("):
        return sw.MOE_ZOO.with_(ep_overlap="1f1b overlap" in run.name)
    raise ValueError(f"no stack for {run.framework!r} ({run.name}).")


def fixed_settings(run, d):
    """The settings ``run`` states, as `planner.published` takes them."""
    out = {}
    if RECOMPUTE.get(run.recompute):   # torchtitan's "selective" is its per-op policy
        titan = run.framework.startswith("torchtitan") and run.recompute == "selective"
        out["recompute"] = "selective_ops" if titan else RECOMPUTE[run.recompute]
    sharding = {"ZeRO-1": 1, "ZeRO-3": 3, "FSDP": 3, "distributed optimizer": 1,
                "DDP": None}.get(run.sharding)
    if sharding is not None:
        out["zero"] = sharding
    if run.framework.startswith("torchtitan") and d.pp > 1:   # microbatches default to pp (pipeline_llama.py)
        out["micro_batch"] = run.global_batch // d.dp // d.pp
        out["v"] = 1 if "Interleaved" not in run.name else 2  # generate_split_points: 2 stages per rank
    elif run.micro_batch:
        out["micro_batch"] = run.micro_batch
    if run.v and d.pp > 1 and "v" not in out:
        out["v"] = run.v
    return out


def run_case(run):
    """``run`` (`published_runs.Run`) as a `cases.Case`."""
    gpus = run.gpus or DEEPSEEK_V2_GPUS
    deg = run.degrees
    dp = deg["dp"] or gpus // (deg["tp"] * deg["pp"] * deg["cp"])
    # the degrees as printed: an EP beyond DP is Megatron-Core's folding, which its stack must offer
    d = ParallelDims(tp=deg["tp"], pp=deg["pp"], cp=deg["cp"], ep=deg["ep"], dp=dp,
                     fold_ep=stack(run).folds(deg["ep"]))
    batch = run.global_batch or d.dp * 8             # OPT: "2M" tokens, 992 sequences of 2,048
    precision = "fp8" if (run.precision or "").startswith("fp8") else "bf16"
    job = planner.Job(run.model, CLUSTERS[run.gpu], gpus, batch * run.seq, stack(run), precision,
                      eager=run.framework.startswith("torchtitan 9dec") and "compile" not in run.name)
    per_token = run.tflops * 1e12 / run.tokens_per_gpu_s if run.tokens_per_gpu_s else None
    megatron = "Megatron-LM's count" in run.flops_rule + run.framework
    if per_token is None and megatron or "dropless" in run.flops_rule:
        # Megatron-Core's count halves causal attention
        per_token = published_counts.palm(run.model, run.seq, causal=True)
    return cases.Case(run.name, run.source, job, d, fixed_settings(run, d), run.tflops, run.counted,
                      per_token,
                      run.memory_gib, run.notes, run.recompute)


def all_checked():
    """The checked set: `cases`' published rows (not the notes' questions) and every published run."""
    return [c for c in cases.all_cases() if c.tflops] + [run_case(r) for r in published_runs.all_runs()]


def generation(case):
    return case.job.cluster.generation, case.job.precision


@functools.lru_cache(maxsize=None)
def calibration():
    """{(generation, precision): (eta, the row it was fitted on)}."""
    by_name = {c.name: c for c in all_checked()}
    return {key: (cases.calibrate(by_name[name]), name) for key, name in CALIBRATION.items()}


def eta_for(case, table=None):
    table = table or calibration()
    return table[generation(case)][0]


def evaluate_all(checked=None, table=None):
    """Each checked row's verdict (`cases.evaluate`), with its row's calibration constant; jobs that
    several rows share are planned once."""
    checked, table = checked or all_checked(), table or calibration()
    plans, out = {}, []
    for case in checked:
        eta = eta_for(case, table)
        key = (case.job, eta)
        if key not in plans:
            plans[key] = planner.plan(case.job, eta)
        out.append(cases.evaluate(case, eta, plans[key]))
    return out


def with_software(case, **changes):
    """The case on a stack with ``changes`` (a switch turned off to see what it is worth)."""
    return dataclasses.replace(case, job=dataclasses.replace(case.job,
                                                             software=case.job.software.with_(**changes)))
