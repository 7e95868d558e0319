"""Chapter 14: published training runs beyond `cases`, one `Run` per row, to check the planner against.

Each `Run` keeps the layout as its source states it (None where the source is silent; "inferred: ..." in
`notes` where a value is read from somewhere else than the row), the published figure as printed
(`published`: value and unit), and the TFLOP/s per GPU it gives, converted in code by the FLOP count
`flops_rule` names (the source's own formula where it has one). The model is chapter 1's `ModelShape`
at the run's sequence, each from the model's paper or configuration, cited in ``model_source``. The
printed tables are in `published_tables`; nothing here plans (`checked` turns each row into a job).
"""
from dataclasses import dataclass

from labs.formulas.shape import ModelShape
from labs.planning import published_tables as t
from labs.planning.published_counts import (A100_PEAK, H100_PEAK, degrees, gpt, korthikanti_eq7, model, palm,
                                            tflops, torchtitan_count)

# the rows `cases` already checks (Narayanan Table 1, Llama 3 Table 4, DeepSeek-V3, the notes' questions)
ALREADY_PRESENT = ("cases.megatron_cases (10 rows)", "cases.llama3_cases (3 rows)",
                   "cases.deepseek_case (1 row)")


@dataclass(frozen=True)
class Run:
    """One published run. ``degrees``: {"tp", "pp", "cp", "ep", "dp"} as `cases.Case.published` holds them, dp
    = GPUs / (tp pp cp) (None where the GPUs are not stated); ``v``: model chunks per pipeline rank; batches
    in sequences; ``sharding``: "DDP", "ZeRO-1", "ZeRO-3", "FSDP", "distributed optimizer"; ``published``:
    (value, unit) exactly as printed; ``tflops``: TFLOP/s per GPU, printed or converted by ``flops_rule``;
    None: the source does not say."""
    name: str
    model: ModelShape        # at the run's sequence
    seq: int
    gpu: str                 # "A100 80GB", "H100 80GB", "H100 96GB HBM2e, 500 W", "H800 80GB"
    gpus: int
    degrees: dict
    framework: str
    published: tuple
    tflops: float
    flops_rule: str
    source: str
    v: int = None
    micro_batch: int = None
    global_batch: int = None
    recompute: str = None    # "none", "selective", "full", or as printed
    precision: str = None
    sharding: str = None
    tokens_per_gpu_s: float = None
    memory_gib: float = None  # peak memory per GPU, where published
    # the recomputation ``tflops`` counts ("full": Narayanan eq. 3), as `cases.Case.counted`
    counted: str = "none"
    notes: str = ""
    model_source: str = ""


def megatron_h100_2024():
    shape = ("the table's heads, hidden, layers; V 131,072, s 4,096 (README); inferred: 4h GeLU MLP, learned "
             "positions (Megatron-LM's defaults, arguments.py at f2e5db40), untied (the sizes fit 12Lh^2 + "
             "2Vh)")
    return [Run(f"Megatron-LM H100, GPT {size}", gpt(f"GPT {size}", L, h, a, 131_072, 4096, tied=False), 4096,
                "H100 80GB", gpus, degrees(gpus, tp, pp), "Megatron-Core r0.8.0", (tf, "per-GPU teraFLOP/s"),
                tf,
                "as printed (the README names no count)",
                "NVIDIA/Megatron-LM f2e5db40 README, images/model_table.png",
                global_batch=batch, sharding="distributed optimizer",
                notes="precision, recomputation, micro-batch not stated; MFU printed = TFLOP/s / 989; "
                      "sharding "
                      "inferred: --overlap-param-gather asserts --use-distributed-optimizer (arguments.py)",
                model_source=shape)
            for size, a, h, L, tp, pp, dp, gpus, batch, tf, mfu, agg in t.MEGATRON_H100_2024]


def korthikanti_2022():
    src = "Korthikanti et al. 2022 (arXiv 2205.05198), Tables 3 and 5"
    shape = "Korthikanti et al. 2022, Table 3, §3 (4h MLP, learned positions, tied), §6 (s 2048, V 51,200)"
    out = []
    for size, a, h, L, tp, pp, gpus, gbs, b, v, t_full, t_sel, inc, mfu, hfu in t.KORTHIKANTI_2022:
        m = gpt(f"GPT {size}", L, h, a, 51_200)
        kw = dict(v=v, micro_batch=b, global_batch=gbs, precision="mixed 16-bit", source=src,
                  model_source=shape)
        out.append(Run(f"Korthikanti {size}, selective + SP", m, 2048, "A100 80GB", gpus, degrees(gpus, tp,
                                                                                                  pp),
                       "Megatron-LM", (mfu, "% MFU"), mfu * A100_PEAK / 1e14,
                       "MFU x 312 (eq. 7: no recomputation "
                       "counted)", recompute="selective", tokens_per_gpu_s=gbs * 2048 / t_sel / gpus,
                       notes="sequence parallelism on; no data parallelism", **kw))
        tok = gbs * 2048 / t_full / gpus
        out.append(Run(f"Korthikanti {size}, full recompute", m, 2048, "A100 80GB", gpus, degrees(gpus, tp,
                                                                                                  pp),
                       "Megatron-LM", (t_full, "s per iteration"), tflops(tok, korthikanti_eq7(m, 2048)),
                       "Korthikanti eq. 7 x tokens/s", recompute="full", tokens_per_gpu_s=tok,
                       notes="the baseline: no sequence parallelism; no data parallelism", **kw))
    gpus, gbs, sec, mfu = t.KORTHIKANTI_530B_DP8
    out.append(Run("Korthikanti 530B, dp 8", out[4].model, 2048, "A100 80GB", gpus, degrees(gpus, 8, 35),
                   "Megatron-LM", (mfu, "% MFU"), mfu * A100_PEAK / 1e14, "MFU x 312", src + ", §6.3", v=3,
                   micro_batch=1, global_batch=gbs, recompute="selective", precision="mixed 16-bit",
                   tokens_per_gpu_s=gbs * 2048 / sec / gpus,
                   notes="inferred: TP 8, PP 35, v 3 as Table 3's 530B; gradient all-reduce not overlapped "
                         "(§6.3)",
                   model_source=shape))
    return out


def narayanan_table2():
    sizes = {174.6: gpt("GPT 174.6B", 96, 12288, 96, 51_200), 529.6: gpt("GPT 529.6B", 105, 20480, 128,
                                                                         51_200)}
    shapes_from = {174.6: "inferred: GPT-3's 96 layers, h 12,288, 96 heads, which eq. 2 makes 174.6B",
                   529.6: "Narayanan et al. 2021, Table 1's 529.6B row"}
    out = []
    for scheme, size, mp, batch, gpus, b, tf, days in t.NARAYANAN_TABLE2:
        zero = scheme == "ZeRO-3"
        out.append(Run(f"Narayanan {scheme} {size}B, {gpus} GPUs", sizes[size], 2048, "A100 80GB", gpus,
                       degrees(gpus, 1 if zero else 8, 1 if zero else mp // 8),
                       "DeepSpeed ZeRO-3" if zero else "Megatron-LM", (tf, "teraFLOP/s per GPU"), tf,
                       "as printed: Narayanan eq. 3 (recomputation counted)",
                       "Narayanan et al. 2021 (arXiv 2104.04473), §5.2, Table 2", micro_batch=b,
                       global_batch=batch,
                       sharding="ZeRO-3" if zero else None, counted="full",
                       notes=("" if zero
                              else f"inferred: TP 8 x PP {mp // 8} from model-parallel size {mp} (TP 8 "
                              "as every Table 1 row with PP > 1); ")
                       + f"{days} days for 300B tokens printed; "
                              "recomputation, precision and schedule not stated in Table 2",
                       model_source=shapes_from[size]))
    return out


def single_runs():
    """BLOOM-176B's logged iteration, OPT-175B's stated figure, DeepSeek-V2's GPU hours."""
    it, sec, gbs, sps, tf = t.BLOOM_LOG
    bloom = Run("BLOOM-176B", model("bloom"), 2048, "A100 80GB", 384, degrees(384, 4, 12),
                "Megatron-DeepSpeed + DeepSpeed", (tf, "TFLOPs (log)"), tf,
                "as logged: Narayanan eq. 3 with the "
                "checkpoint factor 4 (recomputation counted)", "bigscience-workshop/bigscience 9e64edec "
                "train/tr11-176B-ml/README.md", micro_batch=2, global_batch=gbs, recompute="full",
                precision="bf16", sharding="ZeRO-1", tokens_per_gpu_s=gbs * 2048 / sec / 384, counted="full",
                notes=f"iteration {it}: {sec} s, {sps} samples/s; ZeRO-1 is the BF16_Optimizer's own "
                      "(ZERO_STAGE=0)",
                model_source=t.MODEL_SOURCES["bloom"])
    opt = Run("OPT-175B", model("opt-175b"), 2048, "A100 80GB", 992, degrees(992, 8),
              "metaseq (FSDP + Megatron-LM "
              "TP)", (147, "TFLOP/s per GPU, 'up to'"), 147, "as printed; the paper names no count",
              "Zhang et al. 2022 (arXiv 2205.01068), §2.4", precision="fp16", sharding="FSDP",
              notes="inferred: TP 8 and FSDP 124 from the 992 checkpoint shards in 8 model parts (metaseq "
                    "projects/OPT/download_opt175b.md); batch '2M' tokens (Table 1); Adam state fp32",
              model_source=t.MODEL_SOURCES["opt-175b"])
    tok = 1e12 / (t.DEEPSEEK_V2_GPU_HOURS_PER_T_TOKENS * 3600)
    ds2 = model("deepseek-v2")
    v2 = Run("DeepSeek-V2", ds2, 4096, "H800 80GB", None, degrees(None, 1, 16, 1, 8), "HAI-LLM",
             (172.8, "K GPU hours per trillion tokens"), tflops(tok, palm(ds2, 4096)),
             "PaLM count x tokens/s, as "
             "cases.deepseek_case", "DeepSeek-AI 2024 (arXiv 2405.04434), §3.1.3, §3.2.3", v=1,
             global_batch=t.DEEPSEEK_V2_BATCH, recompute="selective", sharding="ZeRO-1", tokens_per_gpu_s=tok,
             notes="GPU count not stated; v 1 inferred (zero-bubble pipeline); 'a portion of the operators "
                   "are "
                   "recomputed'; token dropping in training", model_source=t.MODEL_SOURCES["deepseek-v2"])
    return [bloom, opt, v2]


def megascale():
    m = gpt("GPT 175B (MegaScale)", 96, 12288, 128, 64_000)
    shape = ("MegaScale Table 1 (128 heads), §6.1 (V 64,000, s 2048); inferred: Megatron-LM's 4h GeLU MLP, "
             "learned "
             "positions, tied")
    return [Run(f"MegaScale paper: {method}, {gpus} GPUs", m, 2048, "A100 80GB", gpus, degrees(gpus, 8, 8),
                method +
                (" 285068c8" if method == "Megatron-LM" else ""), (mfu, "% MFU"), mfu * A100_PEAK / 1e14,
                "MFU x 312 (Korthikanti eq. 7 reproduces the Megatron-LM rows)", "Jiang et al. 2024 (arXiv "
                "2402.15627), Table 2", v=6, global_batch=batch, tokens_per_gpu_s=tok / gpus,
                notes=f"{sec} s per iteration; 'Ampere GPUs' (A100 inferred: MFU divides by 312)"
                      + ("; MegaScale changes the model: parallel block, sliding-window attention, LAMB"
                         if method == "MegaScale" else ""), model_source=shape)
            for method, batch, gpus, sec, tok, mfu, agg in t.MEGASCALE_TABLE2]


def torchtitan_runs():
    tt, gpu = "benchmarks/llama3_h100_202412_torchtitan.md", "H100 96GB HBM2e, 500 W"
    out = []
    for row in t.TORCHTITAN_2024_12:
        tab, size, gpus, fsdp, tp, pp, cp, seq, local, gbs, ac, comp, f8, atp, sched, tps, mem = row
        key, s = f"llama3-{size.lower()}", seq or 8192
        m = model(key, s)
        opts = "".join(x for x, on in ((" + compile", comp), (" + Float8", f8), (" + AsyncTP", atp)) if on)
        out.append(Run(f"torchtitan {size} T{tab}, FSDP {fsdp} TP {tp} PP {pp} CP {cp}{opts}" + (f", {sched}"
                   if sched else ""), m, s, gpu, gpus, degrees(gpus, tp, pp, cp), "torchtitan 9dec370, torch "
                   "1963fc8", (tps, "TPS/GPU"), tflops(tps, torchtitan_count(m, s)),
                       "torchtitan's count (6 x "
                   "non-embedding parameters + 12 L h s) x TPS", f"pytorch/torchtitan {tt}, Table {tab}",
                   v=1 if sched == "1F1B" or pp == 1 else None, micro_batch=local if pp == 1 else None,
                   global_batch=gbs or local * fsdp, recompute=ac, precision="fp8 (Float8 nn.Linear)" if f8
                       else
                   "bf16", sharding="FSDP", tokens_per_gpu_s=tps, memory_gib=mem,
                   notes=("inferred: s 8192 (train_configs at 9dec370); " if seq is None else "")
                         + ("inferred: global batch = local x FSDP; " if gbs is None else "")
                         + "memory: the maximum over GPUs", model_source=t.MODEL_SOURCES[key]))
    for size, gpus, fsdp, tp, local, ac, quant, vanilla, async_, speedup in t.TORCHTITAN_ASYNC_TP_2025_06:
        key = f"llama3-{size.lower()}"
        m = model(key, 8192)
        for name, tps in (("vanilla TP", vanilla), ("async TP", async_)):
            out.append(Run(f"torchtitan {size} FSDP {fsdp} TP {tp}, {quant}, {name}", m, 8192, gpu, gpus,
                           degrees(gpus, tp), "torchtitan 820504e, torch 38410cf9", (tps, "tokens/sec"),
                           tflops(tps, torchtitan_count(m, 8192)), "torchtitan's count x tokens/s",
                           "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md", v=1,
                           micro_batch=local, global_batch=local * fsdp, recompute=ac,
                           precision="bf16" if quant == "bf16" else "fp8 (" + quant + ")", sharding="FSDP",
                           tokens_per_gpu_s=tps, notes="torch.compile on; inferred: per GPU (the 2024 page's "
                           "TPS/GPU for this 70B layout), s 8192 (train_configs at 820504e), global = local "
                           "x FSDP",
                           model_source=t.MODEL_SOURCES[key]))
    return out


def nemo_runs():
    out = []
    for name, gpus, gbs, b, seq, tp, pp, cp, vp, tps, tf in t.NEMO_24_07_H100_FP8:
        key = t.NEMO_MODEL_KEYS[name]
        out.append(Run(f"NeMo 24.07 {name}, {gpus} GPUs", model(key, seq), seq, "H100 80GB", gpus,
                       degrees(gpus, tp, pp, cp), "NeMo 24.07", (tf, "Model TFLOP / sec / GPU"), tf,
                       "as printed: "
                       "NeMo's flops_formulas (the PaLM count, full attention)",
                       "NVIDIA/NeMo 8e3d65dc docs/source/"
                       "performance/performance_summary.md", v=vp, micro_batch=b, global_batch=gbs,
                       precision="fp8",
                       tokens_per_gpu_s=tps, notes="recomputation and sharding not stated",
                       model_source=t.MODEL_SOURCES[key]))
    for name, gpus, prec, gbs, b, seq, fsdp, tp, pp, cp, vp, ep, ga, tps, tf in t.NEMO_25_11_H100:
        key = t.NEMO_MODEL_KEYS[name]
        out.append(Run(f"NeMo 25.11 {name}, {gpus} GPUs", model(key, seq), seq, "H100 80GB", gpus,
                       degrees(gpus, tp, pp, cp, ep), "NeMo 25.11 (Megatron-Bridge)", (tf,
                                                                                       "Model TFLOP / sec / "
                                                                                       "GPU"),
                       tf, "as printed: Megatron-LM's count (causal attention halved)",
                       "NVIDIA-NeMo/Megatron-Bridge "
                       "067f987d docs/performance-summary-archive.md, 25.11, DGX-H100", v=vp or 1,
                       micro_batch=b,
                       global_batch=gbs, precision="fp8 (" + prec + ")", sharding="FSDP" if fsdp else "DDP",
                       tokens_per_gpu_s=tps, notes=f"GA {ga} printed; recomputation not stated"
                       + ("; EP spans more than DP (Megatron folds experts over TP x DP)"
                          if ep > gpus // (tp * pp * cp) else ""), model_source=t.MODEL_SOURCES[key]))
    return out


def moe_zoo_runs():
    m, out = model("qwen3-235b"), []
    src = "yanring/Megatron-MoE-ModelZoo e8650517 best_practice/qwen3/readme.md"
    for disp, tp, cp, ep, pp, edp, etp, vpp, dp, fsdp, b, ga, rc, sec, tf, note in t.MOE_ZOO_QWEN3_235B_H100:
        out.append(Run(f"ModelZoo Qwen3-235B TP {tp} PP {pp} EP {ep} {disp}" + (f" ({note})" if note else ""),
                       m, 4096,
                       "H100 80GB", 256, degrees(256, tp, pp, cp, ep), "Megatron-Core (" + disp + ")",
                       (tf, "Per GPU TF"), tf, "as printed (Megatron-LM's count)", src, v=vpp, micro_batch=b,
                       global_batch=2048, recompute=rc or "none", precision="bf16",
                       sharding="FSDP" if fsdp else "distributed optimizer", tokens_per_gpu_s=2048 * 4096
                       / sec / 256,
                       notes=f"{sec} s per step; EDP {edp}, ETP {etp}, GA {ga}; distributed optimizer: the "
                             "model yaml",
                       model_source=t.MODEL_SOURCES["qwen3-235b"]))
    for seq, tp, cp, forced, dropless in t.MOE_ZOO_QWEN3_235B_LONG:
        out.append(Run(f"ModelZoo Qwen3-235B s {seq} CP {cp}", model("qwen3-235b", seq), seq, "H100 80GB",
                       256,
                       degrees(256, tp, 8, cp, 8),
                       "Megatron-Core (DeepEP)", (dropless, "TFLOPS (dropless)"), dropless,
                       "as printed (dropless)",
                       src + ", Long Context", v=4, global_batch=256, recompute="selective (layernorm, moe)",
                       precision="bf16", sharding="distributed optimizer",
                       notes=f"{forced} TFLOPS with forced balance; PP, VPP, EP, recompute from the printed "
                             "command",
                       model_source=t.MODEL_SOURCES["qwen3-235b"]))
    return out


def nemotron4_15b():
    m = model("nemotron4-15b")
    return [Run(f"Nemotron-4 15B, {gpus} GPUs", m, 4096, "H100 80GB", gpus, degrees(gpus, 8), "Megatron-LM",
                (mfu, "% MFU"), mfu * H100_PEAK / 1e14, "MFU x 989 (the paper's peak; PaLM's count)",
                "Parmar et al. 2024 (arXiv 2402.16819), §2, Table 2", v=1, global_batch=batch,
                precision="bf16",
                sharding="distributed optimizer", tokens_per_gpu_s=batch * 4096 / sec / gpus,
                notes=f"{sec} s per iteration; bf16 inferred from the peak the paper quotes",
                model_source=t.MODEL_SOURCES["nemotron4-15b"])
            for dp, gpus, sec, mfu, batch, tokens, days in t.NEMOTRON4_15B_TABLE2]


def all_runs():
    return (megatron_h100_2024() + korthikanti_2022() + narayanan_table2() + single_runs() + megascale()
            + torchtitan_runs() + nemo_runs() + moe_zoo_runs() + nemotron4_15b())
