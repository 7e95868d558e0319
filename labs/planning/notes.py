"""Chapter 14: the source notes' planning claims through the planner: three training recipes, three
interview questions, and which stack implements which of the planner's layouts.

The recipes are the last note's (source 004, §27): a Llama-2-7B fine-tune on 4 A100s, a 70B pre-training
on 64 H100s, a 10B model on two RTX 3090s with ZeRO-3 and the optimizer in host memory. Each is a job
with the note's own layout fixed (`RECIPES`), evaluated beside the planner's fastest layouts; where the
note leaves a number out (sequence length, host memory, the 10B model's shape, the A100s' memory) the
value used is stated in `ASSUMED`. The interview questions (sources 000, 002, 004) are jobs without a
fixed layout (`INTERVIEWS`). The RTX 3090 has no published run to fit an efficiency on: it borrows the
A100's (the same Ampere generation; its matmuls run on the same third-generation tensor cores).
"""
import dataclasses

from labs.dims import ParallelDims
from labs.formulas.shape import ModelShape
from labs.formulas.planning import offload, planner, shapes, software as sw
from labs.planning import checked

GIB = 2 ** 30
# Hugging Face's Trainer on PyTorch FSDP (FSDP1): SHARD_GRAD_OP is ZeRO-2, FULL_SHARD ZeRO-3; gradient
# checkpointing of every layer; attn_implementation="flash_attention_2"; elementwise ops one by one
HF_FSDP = sw.Software("Hugging Face Trainer + FSDP", "the note's torchrun command (source 004, §27.1)",
                      zero_stages=(2, 3), recompute=("none", "full"), schedules=("1f1b",), max_tp=1, max_cp=1,
                      sp=False, kernels="flash", overlap_grad_reduce=True, prefetch=True)
TEN_B = ModelShape("a 10B Llama", layers=32, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000,
                   seq=2048)
ASSUMED = {"seq": "2,048 tokens for recipes 1 and 3 (recipe 1's; recipe 3 gives none)",
           "a100": "A100 80GB (the note says A100)",
           "ten_b": "Llama 2 13B's widths with 32 layers: 10.5B parameters (the note gives only '10B')",
           "host": "256 GiB of host memory and dual-channel DDR4-3200 (51.2 GB/s) in the RTX 3090 "
                   "workstation"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    job: planner.Job
    layout: ParallelDims
    fixed: dict
    note: str                 # the note's own words for its layout and speed


def recipes():
    l7 = dataclasses.replace(shapes.LLAMA2_70B, name="Llama 2 7B", layers=32, hidden=4096, heads=32,
                             kv_heads=32,
                             ffn=11008, seq=2048)
    stack70 = sw.TORCHTITAN.with_(recompute=("none", "selective_ops", "full"))
    offload = sw.DEEPSPEED_OFFLOAD
    return [
        Recipe("7B fine-tune on 4 A100s", planner.Job(l7, shapes.DGX_A100_4, 4, 32 * 2048, HF_FSDP,
                                                      eager=True),
               ParallelDims(dp=4), {"zero": 2, "recompute": "full", "micro_batch": 8},
               "FSDP SHARD_GRAD_OP (ZeRO-2), bf16, gradient checkpointing, FlashAttention-2, 8 per GPU"),
        Recipe("70B pre-training on 64 H100s", planner.Job(shapes.LLAMA2_70B, shapes.DGX_H100, 64, 2048
                                                           * 4096,
                                                           stack70),
               ParallelDims(tp=8, dp=8), {"zero": 3, "recompute": "full", "micro_batch": 64,
                                          "checkpoint_every": 4},
               "TP 8 x FSDP FULL_SHARD 8, 4 accumulation steps, checkpointing every 4 layers; '~2-3 "
               "tokens/sec/GPU'"),
        Recipe("10B on two RTX 3090s", planner.Job(TEN_B, shapes.workstation_3090(), 2, 32 * 2048, offload),
               ParallelDims(dp=2), {"zero": 3, "recompute": "full", "micro_batch": 2, "offload": True,
                                    "checkpoint_every": 2},
               "ZeRO-3 + optimizer offload, fp16, checkpointing every 2 layers, 2 per GPU x 8 accumulation; "
               "'~0.1-0.2 tokens/sec/GPU'"),
    ]


# tokens/s per GPU
NOTE_SPEEDS = {"70B pre-training on 64 H100s": (2, 3), "10B on two RTX 3090s": (0.1, 0.2)}


def eta_for(job, table=None):
    """The job's efficiency: its generation's calibrated constant, the A100's for the RTX 3090."""
    table = table or checked.calibration()
    gen = "A100" if job.cluster.generation == "RTX 3090" else job.cluster.generation
    return table[gen, job.precision][0]


def tokens_per_gpu_s(job, row):
    return job.batch_tokens / row["time"]["step"] / job.gpus


def evaluate_recipe(recipe, table=None):
    """The note's layout at its settings (fits? speed) and the planner's three fastest."""
    eta = eta_for(recipe.job, table)
    row = planner.published(recipe.job, recipe.layout, eta, recipe.fixed)
    result = planner.plan(recipe.job, eta)
    out = {"recipe": recipe, "row": row, "fits": row["fits"], "tokens_per_gpu_s": tokens_per_gpu_s(recipe.job,
                                                                                                   row),
           "memory_gib": sum(row["memory"].values()) / GIB, "best": result["ranked"][:3],
           "of": len(result["ranked"]), "result": result}
    if row["plan"].offload:                     # the 16-bit weights are 2 bytes per parameter of the shard
        need = offload.host_bytes(row["memory"]["weights"] / 2, recipe.job.cluster.gpus_per_node)
        out["host_gib"], out["host_fits"] = need / GIB, need <= recipe.job.cluster.host_bytes
    out["rank"] = planner.rank_of(result, row) if result["ranked"] and row["fits"] else None
    return out


# The interview questions: source 004 §28 ("How would you train a 175B model?": TP 8, PP 8, DP 16 on
# 1,024 GPUs, ZeRO-1), source 002's worked example 3 (175B on 256 A100s: TP 8, PP 4, DP 8, ZeRO-2) and
# source 000 ("70B on 256 GPUs": FSDP2, TP 8, PP 4). GPT-3 175B (Brown et al. 2020, Table 2.1: 96
# layers, h = 12,288, 96 heads, a 3.2M-token batch of 2,048-token sequences) on Selene's A100s; Llama 2
# 70B at 4,096 tokens and a 4M-token batch on H100s; every stack's options (`software.ANY`).
GPT3 = shapes.gpt("GPT-3 175B", 96, 12288, 96, 50_304, 2048)    # GPT-2's 50,257 tokens padded to 128s
INTERVIEWS = {
    "175B on 1,024 GPUs": (planner.Job(GPT3, shapes.SELENE, 1024, 1536 * 2048),
                           ParallelDims(tp=8, pp=8, dp=16), {"zero": 1}),
    "175B on 256 A100s": (planner.Job(GPT3, shapes.SELENE, 256, 1536 * 2048), ParallelDims(tp=8, pp=4, dp=8),
                          {"zero": 2}),
    "70B on 256 GPUs": (planner.Job(shapes.LLAMA2_70B, shapes.DGX_H100, 256, 4 * 2 ** 20),
                        ParallelDims(tp=8, pp=4, dp=8), {"zero": 3}),
}


def answer(question, table=None):
    """The planner's three fastest layouts for an interview question and the note's layout's rank."""
    job, layout, fixed = INTERVIEWS[question]
    eta = eta_for(job, table)
    result = planner.plan(job, eta)
    row = planner.published(job, layout, eta, fixed)
    return {"question": question, "job": job, "best": result["ranked"][:3], "of": len(result["ranked"]),
            "note": row, "note_fits": row["fits"], "note_rank": planner.rank_of(result, row) if row["fits"]
            else None}


# Which of the planner's layouts and settings each stack implements, from its own repository at the
# commit read: DeepSpeed 0.19.6 (deepspeedai/DeepSpeed edaa7221: README, deepspeed/runtime/pipe,
# deepspeed/sequence, deepspeed/moe, deepspeed/module_inject/auto_tp.py), torchtitan (pytorch/torchtitan
# b5bcd76c6: README, torchtitan/distributed/pipeline_parallel.py, torchtitan/config/configs.py) on FSDP2,
# and Megatron-Core 0.20.0 (NVIDIA/Megatron-LM d98e8a64: megatron/core/package_info.py, README,
# megatron/training/arguments.py).
FRAMEWORKS = (
    ("ZeRO-1 / ZeRO-2", "ZeRO stages 1 and 2", "FSDP2 without resharding after forward (ZeRO-2's memory)",
     "distributed optimizer (ZeRO-1)"),
    ("ZeRO-3", "ZeRO stage 3", "FSDP2 (fully_shard)", "Megatron FSDP (--use-megatron-fsdp)"),
    ("HSDP (dp_replicate)", "ZeRO++ hierarchical partitioning", "HSDP: FSDP2 on a 2-D mesh", "-"),
    ("tp, with sp", "AutoTP (Hugging Face models, 2025)", "DTensor TP with sequence parallel, async TP",
     "TP with sequence parallel, --tp-comm-overlap"),
    ("pp, v", "pipeline engine, 1F1B (TrainSchedule)",
     "torch.distributed.pipelining: 1F1B, interleaved, ZBV, "
                                                        "DualPipeV", "1F1B and interleaved (virtual stages)"),
    ("cp", "Ulysses (all-to-all of heads)", "ring context parallel", "--cp-comm-type p2p, a2a, a2a+p2p"),
    ("ep", "DeepSpeed-MoE, AutoEP", "expert parallel for its MoE models",
     "expert parallel, folded over TP x DP"),
    ("offload", "ZeRO-Offload and ZeRO-Infinity", "CPUOffloadPolicy (enable_cpu_offload)",
     "--optimizer-cpu-offload"),
)


def framework_table():
    """`FRAMEWORKS` as a MyST table."""
    rows = ["| the planner's | DeepSpeed 0.19.6 | FSDP2 / torchtitan | Megatron-Core 0.20.0 |",
            "|:--|:--|:--|:--|"]
    return "\n".join(rows + [f"| {' | '.join(r)} |" for r in FRAMEWORKS])
