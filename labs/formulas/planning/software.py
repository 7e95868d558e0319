"""Chapter 14: what a training stack offers and what it overlaps, each switch as its source states it.

The planner's time model (`timing`) charges each collective in full unless the stack running the
job hides it behind compute, and each hiding is a switch here, set for a stack only where its code
or its paper says it does so:

- ``overlap_grad_reduce``: the data-parallel gradient reduction runs in buckets during backward
  (PyTorch DDP's buckets, chapter 2; Megatron-LM ``--overlap-grad-reduce``; FSDP2 reduce-scatters
  each unit's gradients as its backward ends);
- ``overlap_param_gather``: ZeRO-1/2's all-gather of the updated weights runs under the next
  step's forward (Megatron-LM ``--overlap-param-gather``);
- ``prefetch``: ZeRO-3 / FSDP gathers the next unit's weights while this one computes (FSDP2's
  implicit prefetching; DeepSpeed ZeRO-3's prefetch bucket);
- ``tp_overlap``: the tensor-parallel collectives are split and pipelined with the GEMMs beside
  them (Megatron-LM ``--tp-comm-overlap``, Transformer Engine's userbuffers; torchtitan's async TP);
- ``pp_overlap``: the pipeline's sends run while the next micro-batch computes (Megatron-LM's
  interleaved schedule, "pipeline-parallel communication (enabled by default)" in its README);
- ``ep_overlap``: the experts' all-to-alls run under another micro-batch's compute (DeepSeek-V3's
  DualPipe, §3.2.1; Megatron-Core's 1F1B A2A overlap);
- ``cp_overlap``: context parallelism's K/V exchange runs under the attention of the block already
  held (ring attention, chapter 6; Llama 3's all-gather CP is "exposed in the critical path", §3.3.2).

A stack also fixes what the planner may choose (ZeRO stages, recomputation, schedules, how
layers split over pipeline stages, whether a step accumulates gradients over micro-batches), the
kernels its layers run (``kernels``: scores written out, FlashAttention, fused elementwise ops),
whether tensor parallelism comes with sequence parallelism, and the dtype gradients are reduced in.
"""
from dataclasses import dataclass, replace

# chapter 9; "selective_ops": torchtitan's per-op policy; "mlp": Megatron-Core's recompute of the MLP/MoE
# module
RECOMPUTE = ("none", "selective", "selective_ops", "mlp", "full")
SCHEDULES = ("1f1b", "interleaved", "zero_bubble")


@dataclass(frozen=True)
class Software:
    name: str
    source: str
    zero_stages: tuple = (0, 1, 2, 3)
    recompute: tuple = ("none", "selective", "full")
    schedules: tuple = ("1f1b", "interleaved")
    max_tp: int = 64
    max_cp: int = 32
    hsdp: bool = False              # FSDP may shard inside dp_shard ranks and replicate across (chapter 3)
    sp: bool = True                 # sequence parallelism beside tp (chapter 6)
    # "materialized" | "flash" (FlashAttention) | "fused" (and fused elementwise ops)
    kernels: str = "fused"
    recipe: str = "mixed"           # bytes per parameter (chapter 1's `recipes.RECIPES`)
    reduce_bytes: int = 2           # bytes of a gradient element in its reduction (Llama 3: fp32, 4)
    reshard_after_forward: object = True   # FSDP; "not pp": torchtitan's default (kept gathered under PP)
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    prefetch: bool = False
    tp_overlap: bool = False
    pp_overlap: bool = False
    ep_overlap: bool = False
    cp_overlap: bool = False
    offload: tuple = (False,)       # optimizer state in host memory (ZeRO-Offload): `offload`
    # a fused attention kernel's generation: "flash2", "flash3" (and cuDNN's, TE)
    attention: str = "flash2"
    ep_folding: bool = False        # experts folded over tp x dp, consecutive ranks (Megatron-Core, ETP = 1)
    shard_unit: str = "layer"       # what ZeRO-3 gathers at a time: a "layer" (FSDP's wrap) or a "weight"
    max_pp: int = 1024
    uniform_stages: bool = False    # Megatron-LM: L / (pp v) layers in every model chunk, nothing else
    # several micro-batches per step without a pipeline (False: b = the local batch)
    accumulation: bool = True
    permute_fusion: bool = False    # MoE token permutation in fused kernels (`kernels.permutation_bytes`)
    eager_loss: bool = False        # F.cross_entropy on fp32 logits, whose backward peaks above its forward
    # ZeRO-3's forward pre-hooks fire again in the recomputed forward, gathering every weight a third time per
    # micro-batch (DeepSpeed: deepspeedai/DeepSpeed issue #4784, pre_sub_module_forward_function runs in the
    # recomputation; huggingface/transformers issue #47254: "The ZeRO-3 forward pre-hook fires on the
    # recompute forward and all-gathers every param"). FSDP2 gathers once before a unit's backward, which
    # recomputes inside it.
    regather_recompute: bool = False
    expandable_segments: bool = False   # the allocator's expandable segments (`shapes.reserve`)

    def with_(self, **changes):
        return replace(self, **changes)

    def folds(self, ep):
        """Whether a layout with ``ep`` puts its experts on Megatron-Core's folded grid
        (`ParallelDims.fold_ep`): the stack folds, and there are experts to spread."""
        return self.ep_folding and ep > 1

    def reshards(self, pp):
        """Whether FSDP frees a unit's gathered weights after its forward, for a pipeline of pp stages."""
        return pp == 1 if self.reshard_after_forward == "not pp" else bool(self.reshard_after_forward)


_MEGATRON = "NVIDIA/Megatron-LM"
# Narayanan et al. 2021 (arXiv 2104.04473), §4 and §5: data, tensor and pipeline parallelism with the
# interleaved schedule, activation recomputation in every run, scores written out (§4.2's fused softmax),
# no sequence parallelism and no distributed optimizer yet; the gradient all-reduce after backward.
# Megatron-LM splits the layers evenly: "num_layers must be divisible by pipeline_model_parallel_size" and the
# layers per stage by the virtual stages (NVIDIA/Megatron-LM fda81a21, June 2021,
# megatron/model/transformer.py and megatron/arguments.py; the same assertions at f2e5db40,
# megatron/training/arguments.py, under interleaving).
MEGATRON_2021 = Software("Megatron-LM 2021", "Narayanan et al. 2021, §4-5", zero_stages=(0,),
                         recompute=("full",),
                         max_cp=1, sp=False, kernels="materialized", uniform_stages=True)
# Korthikanti et al. 2022 (arXiv 2205.05198), §4-6: sequence parallelism and selective recomputation, the
# same kernels; "the gradient all-reduce is not overlapped" (§6.3).
MEGATRON_2022 = MEGATRON_2021.with_(name="Megatron-LM 2022", source="Korthikanti et al. 2022, §4-6",
                                    recompute=("selective", "full"), sp=True)
# Megatron-Core r0.8.0 as its README at f2e5db40 ran the H100 table: "fine-grained overlapping of
# data-parallel (--overlap-grad-reduce --overlap-param-gather), tensor-parallel (--tp-comm-overlap) and
# pipeline-parallel communication (enabled by default)"; the distributed optimizer keeps bf16 weights and
# fp32 gradients (README: 6 + 12/d bytes per parameter); Transformer Engine's fused attention.
MEGATRON_CORE = Software("Megatron-Core r0.8.0", _MEGATRON + " f2e5db40 README", zero_stages=(0, 1),
                         recompute=("none", "selective", "full"), recipe="mixed_fp32_grads", reduce_bytes=4,
                         overlap_grad_reduce=True, overlap_param_gather=True, tp_overlap=True,
                         pp_overlap=True,
                         cp_overlap=True, attention="flash3", uniform_stages=True)
# Nemotron-4 (Parmar et al. 2024, §2): Megatron-LM with a distributed optimizer, its overlaps of the
# data-parallel collectives as the README of the time documents them; the tensor-parallel overlap needs
# Transformer Engine's userbuffers, which the paper does not state, so it is off.
NEMOTRON = MEGATRON_CORE.with_(name="Megatron-LM (Nemotron-4)", source="Parmar et al. 2024, §2",
                               tp_overlap=False)
# NeMo (24.07, 25.11) runs Megatron-Core with the same overlaps; 25.11 also offers Megatron FSDP. Its
# performance scripts reduce gradients in bf16 under FP8 (NVIDIA/NeMo scripts/performance/helpers.py at
# 02a0e6a5, set_precision_configs: "grad_reduce_in_fp32 = False"), so the gradient buffer is bf16.
NEMO = MEGATRON_CORE.with_(name="NeMo (Megatron-Core)", source="NVIDIA/NeMo performance summaries",
                           zero_stages=(0, 1, 3), prefetch=True, recipe="mixed", reduce_bytes=2)
# NeMo 25.11 (Megatron-Bridge) counts the embedding and the loss as pipeline layers: its Llama 3.1 405B row
# runs 126 layers on PP 8 x VP 8 = 64 chunks, which an even split cannot hold
# Its Qwen3 recipes fuse the token permutation (NVIDIA-NeMo/Megatron-Bridge 067f987d
# src/megatron/bridge/recipes/qwen/h100/qwen3_moe.py: "moe_permute_fusion = True"); so does the ModelZoo
# (model_configs/benchmarking/Qwen3-235B-A22B.yaml: "--moe-permute-fusion: true").
# Its Qwen3-235B row runs EP 32 beside TP 2, PP 8 on 256 GPUs (DP 16): Megatron-Core's expert grid must fit
# EP x ETP into TP x CP x DP = 32, so its experts are folded with ETP = 1.
NEMO_2511 = NEMO.with_(name="NeMo 25.11 (Megatron-Bridge)", uniform_stages=False, permute_fusion=True,
                       ep_folding=True)
# Megatron-MoE-ModelZoo (yanring/Megatron-MoE-ModelZoo e8650517): Megatron-Core with expert parallelism
# folded over tp x dp (its ETP column is 1: MoE parallel folding, Liu et al. 2025, arXiv 2504.14960); its
# "+1f1b overlap" row overlaps the experts' all-to-all with another micro-batch's compute.
# Its Qwen3-235B rows run 94 layers on PP 8 x VPP 4: uneven stages, as Megatron-Core now offers.
MOE_ZOO = MEGATRON_CORE.with_(name="Megatron-Core MoE",
                              source="Megatron-MoE-ModelZoo e8650517 best_practice/qwen3",
                              zero_stages=(0, 1, 3), recompute=("none", "selective", "mlp", "full"),
                              prefetch=True,
                              ep_folding=True, uniform_stages=False, permute_fusion=True)
# DeepSpeed ZeRO-3 as Narayanan et al. 2021 ran it against PTD-P (§5.2, Table 2): no model parallelism,
# each weight gathered by the hooks of its own module, with prefetching (Rajbhandari et al. 2021,
# ZeRO-Infinity §5.1.2), recomputation (the count includes it); no pipeline: "ZeRO-2 and ZeRO-3 are
# incompatible with pipeline parallelism" (deepspeedai/DeepSpeed deepspeed/runtime/pipe/engine.py, since
# fbece50b, April 2021).
DEEPSPEED_ZERO3 = Software("DeepSpeed ZeRO-3 (2021)", "Narayanan et al. 2021, §5.2", zero_stages=(3,),
                           recompute=("full",), max_tp=1, max_pp=1, max_cp=1, sp=False,
                           kernels="materialized",
                           schedules=("1f1b",), overlap_grad_reduce=True, prefetch=True, shard_unit="weight",
                           regather_recompute=True)
# BLOOM (bigscience tr11-176B-ml README): Megatron-DeepSpeed, TP 4, PP 12 with DeepSpeed's 1F1B pipeline
# engine, the BF16_Optimizer's own ZeRO-1, full recomputation, fused softmax kernels (no FlashAttention).
MEGATRON_DEEPSPEED = Software("Megatron-DeepSpeed (BLOOM)", "bigscience tr11-176B-ml README", zero_stages=(1,
                                                                                                           ),
                              recompute=("full",), schedules=("1f1b",), max_cp=1, sp=False,
                              kernels="materialized",
                              recipe="mixed_fp32_grads", reduce_bytes=2)
# OPT-175B (Zhang et al. 2022, §2.4): FSDP with Megatron-LM tensor parallelism, fp16, recomputation.
METASEQ = Software("metaseq (FSDP + Megatron TP)", "Zhang et al. 2022, §2.4", zero_stages=(3,),
                   recompute=("full",),
                   schedules=("1f1b",), max_cp=1, sp=False, kernels="materialized", overlap_grad_reduce=True,
                   prefetch=True)
# MegaScale (Jiang et al. 2024, §3.2-3.3): Megatron-LM with the data-, pipeline- and tensor-parallel
# communication overlapped and fused kernels; its baseline is Megatron-LM at 285068c8 without them.
MEGASCALE_BASELINE = MEGATRON_2022.with_(name="Megatron-LM 285068c8", source="Jiang et al. 2024, §6.1",
                                         kernels="flash", zero_stages=(0, 1), recompute=("none", "selective",
                                                                                         "full"))
MEGASCALE = MEGASCALE_BASELINE.with_(name="MegaScale", source="Jiang et al. 2024, §3", kernels="fused",
                                     overlap_grad_reduce=True, overlap_param_gather=True, tp_overlap=True,
                                     pp_overlap=True)
# Llama 3 (Llama Team 2024, §3.3.2): "Our use of FSDP for Llama 3 shards optimizer states and gradients, but
# for model shards we do not reshard after forward computation": ZeRO-2's memory (weights whole, gradients and
# optimizer state sharded), gradients reduce-scattered in fp32 and accumulated over micro-batches in fp32
# (§3.3.2, "Numerical stability"), prefetching asynchronously; all-gather context parallelism exposed;
# interleaved 1F1B.
LLAMA3 = Software("Llama 3's stack", "Llama Team 2024, §3.3.2", zero_stages=(2,), recipe="mixed_fp32_grads",
                  reduce_bytes=4, overlap_grad_reduce=True, overlap_param_gather=True)
# torchtitan at 9dec370 (Dec. 2024): FSDP2 (reshard after forward unless pipelining: parallelize_llama.py
# apply_fsdp), TP with sequence parallelism and a vocabulary-parallel loss, fp32 gradient reduction
# (mixed_precision_reduce), CP, HSDP, 1F1B / interleaved; its "selective" recomputation saves every other
# matmul's output (_save_list); torch.compile fuses the elementwise ops, eager runs them one by one. Without
# a pipeline a step is one forward and one backward of the local batch (train.py at 9dec370: no gradient
# accumulation, which came with 8570415c, June 2025); a pipeline splits it into micro-batches (by default pp).
# Its loss is PyTorch's on an fp32 copy, "cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))",
# the logits freed before backward (train.py: "del pred").
TORCHTITAN = Software("torchtitan 9dec370", "pytorch/torchtitan 9dec370", zero_stages=(3,),
                      recompute=("none", "selective_ops", "full"), hsdp=True, reduce_bytes=4,
                      reshard_after_forward="not pp", overlap_grad_reduce=True, prefetch=True,
                      accumulation=False, eager_loss=True, expandable_segments=True)
TORCHTITAN_2025 = TORCHTITAN.with_(name="torchtitan 820504e", source="pytorch/torchtitan 820504e",
                                   accumulation=True)
# DeepSeek (V2 §3.1.3, V3 §3.2): HAI-LLM, no TP, ZeRO-1, zero-bubble pipelining (V3: DualPipe, which
# overlaps the all-to-alls of one micro-batch with another's compute).
# Its dispatch and combine are its own kernels (V3 §3.2.2), taken as fused.
HAI_LLM = Software("HAI-LLM", "DeepSeek-AI 2024 (V2 §3.1.3, V3 §3.2)", zero_stages=(1,), max_tp=1,
                   schedules=("zero_bubble",), recipe="mixed_fp32_grads", reduce_bytes=4,
                   overlap_grad_reduce=True,
                   overlap_param_gather=True, pp_overlap=True, ep_overlap=True, permute_fusion=True)
# What a planner user gets by default: every option the planner models that Megatron-Core or torchtitan
# offers (no zero-bubble or DualPipe schedule, offloading or expert folding: each a stack of its own here),
# except Megatron-Core's 1F1B all-to-all overlap: on the one published pair that isolates it (the
# ModelZoo's Qwen3-235B with and without it) the model credits it several times the measured gain.
ANY = Software("any current stack", "Megatron-Core and torchtitan together", zero_stages=(0, 1, 2, 3),
               recompute=("none", "selective", "full"), hsdp=True, recipe="mixed", overlap_grad_reduce=True,
               overlap_param_gather=True, prefetch=True, tp_overlap=True, pp_overlap=True, cp_overlap=True,
               attention="flash3", permute_fusion=True)
# DeepSpeed with ZeRO-Offload (Ren et al. 2021): the optimizer state and its Adam step on the CPU.
DEEPSPEED_OFFLOAD = Software("DeepSpeed ZeRO-3 + offload", "Ren et al. 2021; DeepSpeed docs", zero_stages=(3,
                                                                                                           ),
                             recompute=("none", "full"), schedules=("1f1b",), max_cp=1, sp=False,
                             kernels="flash",
                             recipe="mixed", overlap_grad_reduce=True, prefetch=True, offload=(False, True),
                             shard_unit="weight")
