"""Chapter 14: the planner's inputs. The models it is checked on, and a cluster as its links and peak.

A model is chapter 1's `ModelShape` (`labs.formulas.shape`): its published shapes and the
weight matrices they make, with the way tensor parallelism splits each; the planner reads from that
list what one rank holds. Parameters by weight are chapter 1's (`labs.formulas.flops.
llama_block_params` for a Llama block, 12h^2 + 13h for a GPT block: Narayanan et al. 2021, eq. 2).

Sources of the shapes:
- the GPT models of Narayanan et al. 2021 (arXiv 2104.04473, §5.1, Table 1): V = 51,200, s = 2048,
  4h GeLU MLP, learned positions, embedding tied to the output layer (eq. 2 counts Vh once);
- Llama 2 70B and Llama 3 405B: chapter 1's `memory.MODELS` (Touvron et al. 2023; Llama Team 2024,
  arXiv 2407.21783, Table 3), sequence 8,192 for 405B (Table 4);
- DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437, §4.2): 61 layers, h = 7168, 128 heads, MLA
  (d_c = 512, d_c' = 1536, d_h = 128, d_h^R = 64), first 3 layers dense, then 1 shared and 256 routed
  experts of width 2048, 8 routed per token, s = 4096; vocabulary 129,280 (the released
  configuration; the report says "128K").
"""
from dataclasses import dataclass

from labs.formulas import collectives, flops, memory
from labs.formulas.shape import ModelShape


def gpt(name, layers, hidden, heads, vocab=51_200, seq=2048, tied=True):
    """A GPT of Narayanan et al. 2021, Table 1: 4h GeLU MLP, biases, learned positions, tied embedding
    (Megatron-LM's 2024 H100 table: untied)."""
    return ModelShape(name, layers, hidden, heads, heads, 4 * hidden, vocab, seq, mlp="gelu", tied=tied,
                      positions=True)


def from_gpt_config(cfg):
    """The book's tiny GPT (`labs.model.GPTConfig`): untied head without bias, learned positions."""
    return ModelShape("tiny GPT", cfg.n_layer, cfg.hidden, cfg.n_head, cfg.n_head, 4 * cfg.hidden,
                      cfg.vocab_size,
                      cfg.seq_len, mlp="gelu", tied=False, positions=True)


LLAMA2_70B = memory.MODELS["70B"]
LLAMA3_405B = memory.MODELS["405B"]
DEEPSEEK_V3 = ModelShape("DeepSeek-V3", layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432,
                         vocab=129_280,
                         seq=4096, experts=256, top_k=8, expert_ffn=2048, shared_experts=1, dense_layers=3,
                         mla=(512, 1536, 128, 64))


def llama_params_agree(shape):
    """The weight list against chapter 1's count of a Llama block (`flops.llama_block_params`)."""
    block = flops.llama_block_params(shape.hidden, shape.heads, shape.kv_heads, shape.ffn)["total"]
    return sum(w.numel for w in shape.layer_weights(0)) == block


@dataclass(frozen=True)
class Cluster:
    """A GPU generation and its links; bandwidths in bytes per second, one direction, per GPU."""
    name: str
    generation: str      # the key of the efficiency calibration (one constant per generation and precision)
    gpus_per_node: int
    hbm_bytes: float     # what one GPU holds
    intra_bw: float      # NVLink (or PCIe) inside the node
    inter_bw: float      # the network port of each GPU
    peak_flops: float    # dense BF16 tensor-core peak
    hbm_bw: float        # the GPU memory's bandwidth (the roofline's slope, `kernels`)
    fp8_flops: float = 0.0        # dense FP8 tensor-core peak (0: the GPU has none)
    link: str = "NVLINK"          # NCCL's link type inside the node: "NVLINK" or "PCI" (`links`)
    host_bw: float = 32e9         # PCIe between one GPU and the host (offload, `offload`)
    host_bytes: float = 0.0       # host memory of one node (0: not stated)
    host_mem_bw: float = 0.0      # host memory bandwidth of one node (the CPU's Adam, `offload`)


GIB = 2 ** 30
# The allocator's reserve: an assumption, not a rule the planner ranks or refuses by. PyTorch's caching
# allocator keeps freed blocks for reuse and splits them, so what a run reserves
# (torch.cuda.max_memory_reserved, the figure torchtitan logs) can exceed what its tensors hold (allocated,
# the planner's count). No source read gives that excess for training jobs. GMLake (Guo et al. 2024,
# ASPLOS, arXiv 2401.08156, abstract) reports that its own allocator reduces fragmentation by "15% (up to
# 33%)" on eight LLMs (fine-tuning on A100, with recomputation, offloading and LoRA): a reduction, not the
# share PyTorch reserves above its tensors. Taking it as that share (reserved = allocated / (1 - RESERVE))
# is the book's assumption, and the checked set is against it as a limit: published runs that ran count
# above (1 - RESERVE) of their GPU (chapter 14 counts them). So the planner refuses only what the count
# puts over the GPU, and reports the headroom beside it.
RESERVE = 0.15
# STWeaver's authors (Huang et al. 2025, arXiv 2507.16274, abstract): PyTorch's default allocator can waste
# up to 43 % of memory in LLM training with virtual pipelines and recomputation, a worst case, not a reserve.
STWEAVER_WASTE_MAX = 0.43
# Expandable segments (PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", which torchtitan's launcher sets:
# run_llama_train.sh at 9dec370, line 22; run_train.sh at 820504e, line 24) map more physical pages into one
# growing segment instead of reserving a new block per size, so a freed block of one size serves another
# (PyTorch's "CUDA semantics" notes, "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF"); taken as no
# reserve (pages round up by 2 MiB).
EXPANDABLE_RESERVE = 0.0


def reserve(expandable=False):
    """The assumed share of reserved memory that holds no tensor: `RESERVE`, or `EXPANDABLE_RESERVE`."""
    return EXPANDABLE_RESERVE if expandable else RESERVE


def reserved_bytes(allocated, expandable=False):
    """What the caching allocator would reserve for ``allocated`` bytes of tensors under the assumed
    `reserve`."""
    return allocated / (1 - reserve(expandable))


# Links are priced at what NCCL reaches on them, not their line rate (chapter 11, `placement`): ~370 GB/s
# of NVLink on 8 x H100 (NVIDIA/nccl-tests issue 212) and 46 to 48 GB/s per NDR 400 Gb/s port (issue 290),
# 92 % of the line, which the 200 Gb/s HDR ports of the A100 clusters are taken to reach as well; NCCL's
# own model caps Ampere's NVLink bus bandwidth at 235 GB/s (src/graph/tuning.cc at 01afd20:
# "if (compCap80) busBw = std::min(busBw, 235.0f)").
NET_EFFICIENCY = collectives.NCCL_NDR_BPS[0] / collectives.NDR_IB_BPS
A100_NVLINK = 235e9
# Selene (Narayanan et al. 2021, §5): DGX A100 nodes of 8 x A100 80GB on NVLink 3 / NVSwitch (12
# links x 25 GB/s = 300 GB/s per direction: NVIDIA A100 whitepaper's 600 GB/s both ways), eight
# 200 Gb/s HDR InfiniBand adapters per node (one per GPU: 25 GB/s), peak 312 TFLOP/s in 16 bits,
# HBM2e at 2,039 GB/s (A100 80GB SXM datasheet), PCIe 4.0 x16 to the host.
SELENE = Cluster("Selene, DGX A100 80GB", "A100", 8, 80 * GIB, A100_NVLINK, 200e9 / 8 * NET_EFFICIENCY,
                 312e12,
                 2.039e12, host_bw=32e9, host_bytes=2e12)
# H100 SXM 80GB (NVIDIA H100 datasheet): 989 TFLOP/s dense BF16 (chapter 1), 1,979 dense FP8, HBM3 at
# 3.35 TB/s, PCIe 5.0 x16. Llama 3 (Llama Team 2024, §3.3.1): 8 per server on NVLink (chapter 11's
# 450 GB/s per direction), RoCE at 400 Gb/s per GPU. A DGX H100 has 2 TB of host memory.
H100_SXM = dict(hbm_bw=3.35e12, fp8_flops=1979e12, host_bw=64e9, host_bytes=2e12)
NVLINK, NDR = collectives.NCCL_NVLINK_BPS, collectives.NCCL_NDR_BPS[0]
# What an H100 80GB HBM3 holds: the 81,559 MiB nvidia-smi reports (the output pasted in NVIDIA/nccl
# issue #1264), not 80 GiB; the CUDA context and NCCL's buffers then take their share of it
H100_HBM3_BYTES = 81_559 * 2**20
LLAMA3_CLUSTER = Cluster("Llama 3, H100 80GB", "H100", 8, H100_HBM3_BYTES, NVLINK, NDR, flops.H100_BF16_DENSE,
                         **H100_SXM)
DGX_H100 = Cluster("DGX H100", "H100", 8, H100_HBM3_BYTES, NVLINK, NDR, flops.H100_BF16_DENSE, **H100_SXM)
# DeepSeek-V3 (§3.1, §3.2.2): 8 x H800 per node, NVLink 160 GB/s and InfiniBand 50 GB/s as the report
# gives them; the H800 is the H100's chip with fewer NVLinks, so its peaks are taken to be the H100's.
H800_CLUSTER = Cluster("DeepSeek-V3, H800", "H100", 8, 80 * GIB, 160e9, 50e9 * NET_EFFICIENCY,
                       flops.H100_BF16_DENSE,
                       **H100_SXM)
# torchtitan's benchmarks (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md): Grand Teton
# hosts of 8 H100 "96GB HBM2e with 2.4 TB/sec", NVLink, 400 Gb/s RDMA per GPU, a 500 W power limit; "the
# actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value": the page divides
# by the SXM's, and so does this cluster, with its own efficiency constant (another generation).
GRAND_TETON = Cluster("Grand Teton, H100 96GB HBM2e 500 W", "H100 96GB 500W", 8, 96 * GIB, NVLINK, NDR,
                      flops.H100_BF16_DENSE, 2.4e12, fp8_flops=1979e12, host_bw=64e9)
# The notes' recipes: four A100 80GB in one DGX A100; two GeForce RTX 3090 (GA102, NVIDIA Ampere GA102
# whitepaper, Appendix A: 24 GB GDDR6X at 936 GB/s, 71 TFLOP/s of FP16 or BF16 tensor math with FP32
# accumulation) on PCIe 4.0 x16 without NVLink, in a workstation whose host memory is an input.
DGX_A100_4 = Cluster("DGX A100, 4 GPUs", "A100", 4, 80 * GIB, A100_NVLINK, 200e9 / 8 * NET_EFFICIENCY, 312e12,
                     2.039e12, host_bw=32e9, host_bytes=2e12)


def workstation_3090(host_gib=256, host_mem_bw=51.2e9):
    """Two RTX 3090s on PCIe 4.0 (32 GB/s per direction, the only link between them) in a host with
    ``host_gib`` GiB of memory at ``host_mem_bw`` (dual-channel DDR4-3200: 51.2 GB/s)."""
    return Cluster("2 x RTX 3090, PCIe", "RTX 3090", 2, 24 * GIB, 32e9, 32e9, 71e12, 936e9, link="PCI",
                   host_bw=32e9,
                   host_bytes=host_gib * GIB, host_mem_bw=host_mem_bw)
