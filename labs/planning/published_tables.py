"""Chapter 14: published training runs, each table as its source prints it (`published_runs` reads them).

Numbers are typed as printed (a table's rounding kept), and the models' shapes as their configurations
print them (chapter 1's `ModelShape`); nothing here is computed. Each table names its source: repository, path
and commit, or paper, table and the text it was read from.
"""
from labs.formulas.shape import ModelShape


# Megatron-LM README, "Training Speed and Scalability": images/model_table.png, added in NVIDIA/Megatron-LM
# commit f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4 (2024-07-15, "New scaling figures on H100 GPUs"). The README
# beside it: GPT models, vocabulary 131,072, sequence 4,096, up to 6,144 H100s, --overlap-grad-reduce
# --overlap-param-gather --tp-comm-overlap, end-to-end throughput; the scaling plots say Megatron-Core r0.8.0.
# (size, heads, hidden, layers, TP, PP, DP, GPUs, batch in sequences, TFLOP/s per GPU, MFU %, aggregate
# PFLOP/s)
MEGATRON_H100_2024 = (
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41, 19.6),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47, 44.7),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49, 93.9),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46, 176.5),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42, 322.3),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43, 645.9),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44, 997.2),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48, 1457.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47, 2825.6),
)

# Korthikanti et al. 2022 (arXiv 2205.05198), Table 3 (configurations) and Table 5 (end-to-end iteration
# time, MFU, HFU); §6: Selene, 80GB A100s, s = 2048, V = 51,200, "mixed precision", the interleaved schedule
# with 3 stages per device for 175B and 530B, no data parallelism. Read from a Markdown transcription of the
# arXiv PDF (search index file 69442322288); the MFU and HFU columns are also in the Megatron-LM README at
# commit f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4^ ("Training Speed and Scalability" table).
# (size, heads, hidden, layers, TP, PP, GPUs, global batch, micro-batch, v (None: not stated),
#  s per iteration with full recomputation, s with sequence parallelism + selective recomputation,
#  throughput increase %, MFU %, HFU %)
KORTHIKANTI_2022 = (
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10, 29.0, 41.5, 43.7),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75, 31.8, 51.4, 52.8),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83, 29.7, 56.0, 57.0),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, None, 94.42, 71.49, 32.1, 56.3, 57.0),
)
# §6.3: the 530B model at 8-way data parallelism, batch per replica unchanged: 37.83 s becomes 39.15 s and the
# MFU 56.0 % becomes 54.2 % (also in the abstract). (GPUs, global batch, s per iteration, MFU %)
KORTHIKANTI_530B_DP8 = (2240, 2240, 39.15, 54.2)

# Narayanan et al. 2021 (arXiv 2104.04473), §5.2, Table 2: ZeRO-3 without model parallelism against PTD
# parallelism, Selene A100s, s = 2048, V = 51,200. Read from the image of the table in cli99/llm-analysis,
# figures/megatron-lm-2nd-table-2.png, commit d841e40aec8c84b9e76ba9cfbce67418adb172bd. The caption: the
# 530B model "did not fit on 560 GPUs when using a microbatch size of 4 with ZeRO-3", hence 640 GPUs and
# batch 2,560 on the starred row.
# (scheme, billions of parameters, model-parallel size, batch, GPUs, micro-batch, TFLOP/s per GPU,
#  days to train 300B tokens)
NARAYANAN_TABLE2 = (
    ("ZeRO-3", 174.6, 1, 1536, 384, 4, 144, 90),
    ("ZeRO-3", 174.6, 1, 1536, 768, 2, 88, 74),
    ("ZeRO-3", 174.6, 1, 1536, 1536, 1, 44, 74),
    ("ZeRO-3", 529.6, 1, 2560, 640, 4, 138, 169),
    ("ZeRO-3", 529.6, 1, 2240, 1120, 2, 98, 137),
    ("ZeRO-3", 529.6, 1, 2240, 2240, 1, 48, 140),
    ("PTD-P", 174.6, 96, 1536, 384, 1, 153, 84),
    ("PTD-P", 174.6, 96, 1536, 768, 1, 149, 43),
    ("PTD-P", 174.6, 96, 1536, 1536, 1, 141, 23),
    ("PTD-P", 529.6, 280, 2240, 560, 1, 171, 156),
    ("PTD-P", 529.6, 280, 2240, 1120, 1, 167, 80),
    ("PTD-P", 529.6, 280, 2240, 2240, 1, 159, 42),
)

# BLOOM-176B, bigscience-workshop/bigscience, train/tr11-176B-ml/README.md, commit
# 9e64edec2ad1fb9263bf39ba616a84ff64b4d947: 384 A100 80GB, TP=4 PP=12 DP=8 MBS=2, GBS 2048, SEQ_LEN 2048,
# bf16, ZeRO stage 1 (the BF16_Optimizer "implements its own ZeRO Stage 1"), activation checkpointing, and
# the log line at the end of the first epoch ("Important checkpoints"):
# (iteration, s per iteration, global batch, samples per second, TFLOPs as logged)
BLOOM_LOG = (85376, 104.70, 2048, 19.561, 149.77)

# MegaScale (Jiang et al. 2024, arXiv 2402.15627), §6.1, Tables 1 and 2: the 175B model (96 layers, h =
# 12,288, 128 heads, TP 8, PP 8, six interleaved stages), s = 2048, V = 64,000, on up to 12,288 "NVIDIA Ampere
# GPUs"; Megatron-LM at commit 285068c8 against MegaScale (parallel transformer block, sliding-window
# attention, LAMB, overlapped 3D communication). Read from a text transcription of the arXiv PDF (search index
# file 61225413316). (method, batch, GPUs, s per iteration, tokens/s, MFU %, aggregate PFLOP/s)
MEGASCALE_TABLE2 = (
    ("Megatron-LM", 768, 256, 40.0, 39.3e3, 53.0, 43.3),
    ("Megatron-LM", 768, 512, 21.2, 74.1e3, 49.9, 77.6),
    ("Megatron-LM", 768, 768, 15.2, 103.8e3, 46.7, 111.9),
    ("Megatron-LM", 768, 1024, 11.9, 132.7e3, 44.7, 131.9),
    ("Megatron-LM", 6144, 3072, 29.02, 433.6e3, 48.7, 466.8),
    ("Megatron-LM", 6144, 6144, 14.78, 851.6e3, 47.8, 916.3),
    ("Megatron-LM", 6144, 8192, 12.24, 1027.9e3, 43.3, 1106.7),
    ("Megatron-LM", 6144, 12288, 8.57, 1466.8e3, 41.2, 1579.5),
    ("MegaScale", 768, 256, 32.0, 49.0e3, 65.3, 52.2),
    ("MegaScale", 6144, 12288, 6.34, 1984.0e3, 55.2, 2166.3),
)
# rows whose aggregate is not MFU x 312 TFLOP/s x GPUs in the transcription (the others agree to 0.1)
MEGASCALE_AGGREGATE_MISMATCH = {("Megatron-LM", 256): 43.3, ("Megatron-LM", 512): 77.6, ("Megatron-LM",
                                                                                         1024): 131.9,
                                ("MegaScale", 12288): 2166.3}

# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan, last changed in commit
# 820504e20d1149fbf0b98c567af24c4b0433b22d; runs on torch 1963fc8, torchao eab345c, torchtitan 9dec370,
# December 2024): Grand Teton hosts of 8 H100s with 96GB HBM2e at 500 W, 400 Gb/s RDMA per GPU; TPS/GPU at
# iteration 90; memory is the maximum over GPUs. (table, model, GPUs, FSDP, TP, PP, CP, seq (None: not
# printed), local batch, global batch (None: not printed), activation checkpointing, compile, float8,
# async TP, schedule, tokens/s per GPU, memory GiB)
TORCHTITAN_2024_12 = (
    (1, "8B", 8, 8, 1, 1, 1, None, 2, 16, "selective", False, False, False, None, 5762, 82.4),
    (1, "8B", 8, 8, 1, 1, 1, None, 2, 16, "selective", True, False, False, None, 6667, 77.0),
    (1, "8B", 8, 8, 1, 1, 1, None, 2, 16, "selective", True, True, False, None, 8532, 76.8),
    (2, "8B", 8, 8, 1, 1, 1, 32768, 1, None, "full", True, True, False, None, 3890, 83.9),
    (2, "8B", 8, 4, 1, 1, 2, 65536, 1, None, "full", True, True, False, None, 2540, 84.2),
    (2, "8B", 8, 2, 1, 1, 4, 131072, 1, None, "full", True, True, False, None, 1071, 84.0),
    (2, "8B", 8, 1, 1, 1, 8, 262144, 1, None, "full", True, True, False, None, 548, 84.5),
    (3, "8B", 128, 128, 1, 1, 1, None, 2, 256, "selective", False, False, False, None, 5605, 67.0),
    (3, "8B", 128, 128, 1, 1, 1, None, 2, 256, "selective", True, False, False, None, 6514, 62.0),
    (3, "8B", 128, 128, 1, 1, 1, None, 2, 256, "selective", True, True, False, None, 8380, 61.8),
    (4, "70B", 256, 32, 8, 1, 1, None, 16, 512, "full", True, True, False, None, 829, 71.9),
    (4, "70B", 256, 32, 8, 1, 1, None, 16, 512, "full", True, True, True, None, 876, 67.6),
    (5, "405B", 512, 8, 8, 8, 1, None, 32, 256, "full", True, True, True, "1F1B", 100, 82.5),
    (5, "405B", 512, 8, 8, 8, 1, None, 32, 256, "full", True, True, True, "Interleaved 1F1B", 128, 72.7),
    (6, "405B", 512, 8, 8, 8, 1, 32768, 8, None, "full", True, True, True, "1F1B", 76, 75.3),
    (6, "405B", 512, 4, 8, 8, 2, 65536, 8, None, "full", True, True, True, "1F1B", 47, 75.9),
    (6, "405B", 512, 2, 8, 8, 4, 131072, 8, None, "full", True, True, True, "1F1B", 31, 77.1),
    (6, "405B", 512, 1, 8, 8, 8, 262144, 8, None, "full", True, True, True, "1F1B", 16, 84.9),
)
# the same page: "the 1D Llama 3.1 8B model training on 8 or 128 H100 GPUs without Float8 achieves 33% to
# 39% MFU" (H100 SXM peak, which the page says overstates its 500 W HBM2e parts)
TORCHTITAN_2024_12_MFU_RANGE = (33, 39)

# torchtitan, benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (same hardware; torch 38410cf9, torchtitan
# 820504e, June 2025). (model, GPUs, FSDP, TP, local batch, activation checkpointing, quantization,
# vanilla TP tokens/s, async TP tokens/s, printed speedup)
TORCHTITAN_ASYNC_TP_2025_06 = (
    ("70B", 256, 32, 8, 16, "full", "bf16", 597.3, 652.4, 1.09),
    ("70B", 256, 32, 8, 16, "full", "fp8 tensorwise", 809.8, 942.4, 1.16),
    ("8B", 64, 8, 8, 12, "selective (per op)", "bf16", 4378, 4809.4, 1.10),
    ("8B", 64, 8, 8, 12, "selective (per op)", "fp8 tensorwise", 5078.1, 5570.1, 1.10),
)
# Left out: the page's four float8 rowwise rows (70B and 8B, vanilla and async TP). The planner has one FP8
# eta per generation and no term for the scaling recipe, so it prices rowwise exactly as tensorwise, while
# the page's table prints 599.6 tokens/s for 70B vanilla TP rowwise against 809.8 tensorwise, and notes that
# "the low baseline performance of the vanilla TP float8 rowwise training is being addressed"
# (pytorch/torchtitan issue 1207). In the set they would be misses the model cannot name.
TORCHTITAN_ASYNC_TP_ROWWISE_LEFT_OUT = ("70B vanilla TP fp8 rowwise", 599.6,
                                        "70B vanilla TP fp8 tensorwise", 809.8)

# NeMo 24.07 pre-training, FP8, DGX-H100: NVIDIA/NeMo docs/source/performance/performance_summary.md at
# commit 8e3d65dcfe3504689bfc5b6e67d502780aacad41 ("24.07 perf numbers", 2024-09-09; the page was removed in
# d31653f7 and moved to the NeMo docs). (model, GPUs, GBS, MBS, seq, TP, PP, CP, VP, tokens/s per GPU,
# model TFLOP/s per GPU)
NEMO_24_07_H100_FP8 = (
    ("GPT3-5B", 64, 2048, 4, 2048, 1, 1, 1, 1, 23406, 765),
    ("GPT3-20B", 64, 256, 2, 2048, 2, 1, 1, 1, 5851, 750),
    ("GPT3-175B", 128, 256, 1, 2048, 4, 8, 1, 6, 716, 771),
    ("GPT3-175B", 512, 2048, 2, 2048, 4, 8, 1, 6, 825, 888),
    ("LLAMA2-7B", 8, 128, 1, 4096, 1, 1, 1, 1, 16934, 780),
    ("LLAMA2-13B", 16, 128, 1, 4096, 1, 4, 1, 10, 8715, 760),
    ("LLAMA2-70B", 64, 128, 1, 4096, 4, 4, 1, 20, 1728, 768),
    ("Nemotron-8B", 64, 256, 4, 4096, 2, 1, 1, 1, 12507, 643),
    ("Nemotron-22B", 64, 256, 2, 4096, 2, 4, 1, 10, 4312, 562),
    ("Nemotron-340B", 128, 32, 1, 4096, 8, 8, 1, 12, 326, 686),
    ("LLAMA3-8B", 8, 128, 1, 8192, 1, 1, 2, 1, 12273, 711),
    ("LLAMA3-70B", 64, 128, 1, 8192, 4, 4, 2, 5, 1524, 734),
)

# NeMo 25.11 container, pre-training on DGX-H100: NVIDIA-NeMo/Megatron-Bridge
# docs/performance-summary-archive.md at commit 067f987df03b8355b03192d88d70f1709fedf51a, "25.11 NeMo
# Container", "System: DGX-H100" (FSDP: 0 means DDP; "n/a" VP printed as None). (model, GPUs, precision, GBS,
# MBS, seq, FSDP, TP, PP, CP, VP, EP, GA, tokens/s per GPU, model TFLOP/s per GPU). Left out: GPT OSS 120B
# (its shape is not in a file read here; its GA of 2 is not GBS / (MBS x DP) = 8).
NEMO_25_11_H100 = (
    ("LLAMA3_8B", 8, "FP8-CS", 128, 1, 8192, 8, 1, 1, 1, None, 1, 16, 14451, 744),
    ("LLAMA3_70B", 64, "FP8-CS", 128, 1, 8192, 0, 4, 8, 1, 5, 1, 64, 1602, 719),
    ("LLAMA3.1_405B", 1024, "FP8-CS", 512, 1, 8192, 0, 8, 8, 2, 8, 1, 64, 292, 737),
    ("Qwen3_30B_a3B", 16, "FP8-CS", 512, 2, 4096, 0, 1, 2, 1, 24, 8, 32, 5275, 121),
    ("Qwen3_235B_a22B", 256, "FP8-CS", 2048, 1, 4096, 0, 2, 8, 1, 4, 32, 128, 1575, 233),
)

# Megatron-MoE-ModelZoo (yanring/Megatron-MoE-ModelZoo), best_practice/qwen3/readme.md at commit
# e8650517d60d71ab73fc6b3b0388cac4ba435181: Qwen3-235B-A22B, 256 H100s, BF16, sequence 4,096, GBS 2,048.
# (dispatcher, TP, CP, EP, PP, EDP, ETP, VPP, DP, FSDP, MBS, GA, recompute, s per step, TFLOP/s per GPU,
# notes)
MOE_ZOO_QWEN3_235B_H100 = (
    ("DeepEP", 2, 1, 32, 8, 1, 1, 4, 16, False, 1, 128, "norm, act", 19.7, 245, ""),
    ("DeepEP", 2, 1, 32, 8, 1, 1, 4, 16, False, 1, 128, "norm, act", 17.6, 276, "+1f1b overlap"),
    ("DeepEP", 2, 1, 8, 1, 32, 1, 1, 128, True, 4, 4, "full", 17.6, 276, "disable log para norm"),
    ("A2A", 2, 1, 8, 32, 1, 1, 3, 4, False, 1, 512, "norm, act", 24.2, 200, ""),
    ("DeepEP", 4, 1, 8, 8, 4, 1, 4, 8, False, 1, 256, "", 29.0, 167, ""),
)
# the same page, "Long Context": 32 nodes, DeepEP, bf16, PP 8, VPP 4, EP 8, GBS 256, --recompute-granularity
# selective --recompute-modules layernorm moe (the command printed under the table).
# (seq, TP, CP, TFLOP/s forced balance, TFLOP/s dropless)
MOE_ZOO_QWEN3_235B_LONG = (
    (16384, 4, 1, 295, 237),
    (32768, 4, 2, 335, 277),
    (65536, 4, 4, 368, 320),
    (131072, 4, 8, 389, 357),
)

# Nemotron-4 15B (Parmar et al. 2024, arXiv 2402.16819), §2 and Table 2: 384 DGX H100 nodes, "989 teraFLOP/s"
# bf16 peak, 8-way tensor parallelism, data parallelism with a distributed optimizer, sequence 4,096. Read
# from a text transcription of the arXiv PDF (search index file 61211626093).
# (DP, GPUs, s per iteration, MFU %, batch in sequences, billions of tokens, days)
NEMOTRON4_15B_TABLE2 = (
    (96, 768, 0.57, 34.3, 384, 200, 0.8),
    (192, 1536, 0.58, 33.3, 768, 200, 0.4),
    (288, 2304, 0.64, 30.5, 1152, 7600, 11.9),
)

# DeepSeek-V2 (DeepSeek-AI 2024, arXiv 2405.04434), §3.1.3 and §3.2.3: H800 nodes of 8, HAI-LLM with 16-way
# zero-bubble pipeline parallelism, 8-way expert parallelism, ZeRO-1 data parallelism, no tensor parallelism,
# "a portion of the operators are recomputed"; 172.8K GPU hours per trillion tokens; batch ramped from 2,304
# to 9,216 sequences of 4K. The GPU count is not given. Read from an HTML transcription of the arXiv page
# (search index file 53994610483).
DEEPSEEK_V2_GPU_HOURS_PER_T_TOKENS = 172.8e3
DEEPSEEK_V2_BATCH = 9216


# --- the models' shapes, as their configurations print them ------------------------------------------
# Each is chapter 1's `ModelShape` at the sequence the model's configuration names (a run at another
# length replaces ``seq``); `MODEL_SOURCES` names where each shape was read.

_TT = "torchtitan 9dec370 torchtitan/models/llama/__init__.py (dims, ffn multipliers); "
_N = "NVIDIA/NeMo 8e3d65dc nemo/collections/llm/gpt/model/"
_NV = "; vocabulary: NeMo nemo/collections/common/parts/perf_metrics_utils.py LLM_VOCAB_SIZE_MAP (0bbc558b)"
_L3 = ("ffn as printed in " + _N + "llama.py {}; vocabulary 128,256: tiktoken's 128,000 + 256 reserved "
       "(torchtitan datasets/tokenizer/tiktoken.py)")
_ZOO = "Megatron-MoE-ModelZoo e8650517 model_configs/benchmarking/"
_GPT = dict(mlp="gelu", tied=True, positions=True)            # Megatron's GPT: 4h MLP, learned positions
_LLAMA = dict(mlp="swiglu", tied=False, positions=False)
_NEMOTRON = dict(mlp="squared_relu", tied=False, positions=False, bias=False)
MODEL_SHAPES = {
    "llama3-8b": ModelShape("Llama 3.1 8B", 32, 4096, 32, 8, 14336, 128_256, 8192, **_LLAMA),
    "llama3-70b": ModelShape("Llama 3.1 70B", 80, 8192, 64, 8, 28672, 128_256, 8192, **_LLAMA),
    "llama3-405b": ModelShape("Llama 3.1 405B", 126, 16384, 128, 8, 53248, 128_256, 8192, **_LLAMA),
    "llama2-7b": ModelShape("Llama 2 7B", 32, 4096, 32, 32, 11008, 32_000, 4096, **_LLAMA),
    "llama2-13b": ModelShape("Llama 2 13B", 40, 5120, 40, 40, 13824, 32_000, 4096, **_LLAMA),
    "llama2-70b": ModelShape("Llama 2 70B", 80, 8192, 64, 8, 28672, 32_000, 4096, **_LLAMA),
    "gpt3-5b": ModelShape("GPT3-5B", 24, 4096, 32, 32, 16384, 51_200, 2048, **_GPT),
    "gpt3-20b": ModelShape("GPT3-20B", 44, 6144, 48, 48, 24576, 51_200, 2048, **_GPT),
    "gpt3-175b": ModelShape("GPT3-175B", 96, 12288, 96, 96, 49152, 51_200, 2048, **_GPT),
    "nemotron-8b": ModelShape("Nemotron-8B", 32, 4096, 32, 32, 16384, 256_000, 4096, **_NEMOTRON),
    "nemotron-22b": ModelShape("Nemotron-22B", 40, 6144, 48, 48, 24576, 256_000, 4096, **_NEMOTRON),
    "nemotron-340b": ModelShape("Nemotron-4 340B", 96, 18432, 96, 8, 73728, 256_000, 4096, **_NEMOTRON),
    "nemotron4-15b": ModelShape("Nemotron-4 15B", 32, 6144, 48, 8, 24576, 256_000, 4096, **_NEMOTRON),
    "bloom": ModelShape("BLOOM-176B", 70, 14336, 112, 112, 4 * 14336, 250_880, 2048, mlp="gelu", tied=True,
                        positions=False),
    "opt-175b": ModelShape("OPT-175B", 96, 12288, 96, 96, 4 * 12288, 50_265, 2048, mlp="relu", tied=True,
                           positions=True, bias=True),
    "qwen3-235b": ModelShape("Qwen3-235B-A22B", 94, 4096, 64, 4, 12288, 151_936, 4096, head_width=128,
                             experts=128, top_k=8, expert_ffn=1536, dense_layers=0, **_LLAMA),
    "qwen3-30b": ModelShape("Qwen3-30B-A3B", 48, 2048, 32, 4, 6144, 151_936, 4096, head_width=128,
                            experts=128,
                            top_k=8, expert_ffn=768, **_LLAMA),
    "mixtral-8x7b": ModelShape("Mixtral-8x7B", 32, 4096, 32, 8, 14336, 32_000, 4096, experts=8, top_k=2,
                               expert_ffn=14336, **_LLAMA),
    "deepseek-v2": ModelShape("DeepSeek-V2", 60, 5120, 128, 128, 12288, 102_400, 4096, experts=160, top_k=6,
                              expert_ffn=1536, shared_experts=2, dense_layers=1, mla=(512, 1536, 128, 64),
                              **_LLAMA),
}
MODEL_SOURCES = {
    "llama3-8b": _TT + _L3.format("Llama3Config8B"),
    "llama3-70b": _TT + _L3.format("Llama3Config70B"),
    "llama3-405b": _TT + _L3.format("Llama31Config405B"),
    "llama2-7b": _N + "llama.py Llama2Config7B" + _NV,
    "llama2-13b": _N + "llama.py Llama2Config13B" + _NV,
    "llama2-70b": _N + "llama.py Llama2Config70B" + _NV,
    "gpt3-5b": _N + "base.py GPTConfig5B" + _NV,
    "gpt3-20b": _N + "base.py GPTConfig20B" + _NV,
    "gpt3-175b": _N + "base.py GPTConfig175B" + _NV,
    "nemotron-8b": _N + "nemotron.py Nemotron3Config8B" + _NV,
    "nemotron-22b": _N + "nemotron.py Nemotron4Config22B" + _NV,
    "nemotron-340b": _N + "nemotron.py Nemotron4Config340B" + _NV,
    "nemotron4-15b": "Parmar et al. 2024, Table 1 and §2 (squared ReLU, untied, RoPE, GQA, no biases); ffn "
                     "from "
                     + _N + "nemotron.py Nemotron4Config15B",
    "bloom": "bigscience 9e64edec train/tr11-176B-ml/README.md: NHIDDEN, NLAYERS, NHEADS, the 250,880-row "
             "embedding, "
             "12h^2 + 13h per layer (so a 4h GeLU MLP with biases), v*h counted once (tied); ALiBi",
    "opt-175b": "Zhang et al. 2022, Table 1, §2.1-2.2 (ReLU, s 2048, 'largely follow Brown et al.': inferred "
                "4h MLP "
                "with biases, learned positions, tied); vocabulary: the 50,265 entries of metaseq f7ffa5fd "
                "projects/OPT/assets/gpt2-vocab.json (the embedding may be padded)",
    "qwen3-235b": _ZOO + "Qwen3-235B-A22B.yaml (every layer MoE, no shared expert, heads of 128); vocabulary "
                  "inferred: the tokenizer's padded to a multiple of 1,187 (--make-vocab-size-divisible-by)",
    "qwen3-30b": _ZOO + "Qwen3-30B-A3B.yaml; vocabulary inferred as for Qwen3-235B-A22B",
    "mixtral-8x7b": "huggingface/transformers ad467bd7 src/transformers/models/mixtral/"
                    "configuration_mixtral.py: MixtralConfig's defaults, 'a similar configuration to that "
                    "of the Mixtral-7B-v0.1' (vocab 32,000, h 4,096, ffn 14,336, 32 layers, 32 heads, 8 KV "
                    "heads, 8 experts, top-2, untied; every layer MoE); trained at 4,096 here (its window)",
    "deepseek-v2": "DeepSeek-V2 §3.1.2 (60 layers, h 5120, 128 heads, MLA 512/1536/128/64, 2 shared + 160 "
                   "routed "
                   "experts of 1536, 6 routed, first layer dense); dense ffn and vocabulary (100K padded to "
                   "a "
                   "multiple of 3,200) from " + _ZOO + "DeepSeek-V2.yaml",
}
# the `MODEL_SHAPES` key of each NeMo table's model name
NEMO_MODEL_KEYS = {"GPT3-5B": "gpt3-5b", "GPT3-20B": "gpt3-20b", "GPT3-175B": "gpt3-175b",
                   "LLAMA2-7B": "llama2-7b",
             "LLAMA2-13B": "llama2-13b", "LLAMA2-70B": "llama2-70b", "Nemotron-8B": "nemotron-8b",
             "Nemotron-22B": "nemotron-22b", "Nemotron-340B": "nemotron-340b", "LLAMA3-8B": "llama3-8b",
             "LLAMA3-70B": "llama3-70b", "LLAMA3_8B": "llama3-8b", "LLAMA3_70B": "llama3-70b",
             "LLAMA3.1_405B": "llama3-405b", "Qwen3_30B_a3B": "qwen3-30b", "Qwen3_235B_a22B": "qwen3-235b"}
