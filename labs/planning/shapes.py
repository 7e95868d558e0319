"""Chapter 14: the planner's inputs. A model as its weight matrices, a cluster as its links and peak.

A model is described by its published shapes; `weights` lists every weight a layer, the embedding and
the head hold, with the way tensor parallelism splits it (Shoeybi et al. 2019, §3: q, k, v and the
first MLP matrix by columns, the output projections by rows, the vocabulary by rows of the embedding
and of the head). From that list the planner reads what one rank holds; nothing else counts
parameters. Parameters by weight are chapter 1's (`labs.memory_budget.compute.llama_block_params`
for a Llama block, 12h^2 + 13h for a GPT block: Narayanan et al. 2021, eq. 2).

Sources of the shapes:
- the GPT models of Narayanan et al. 2021 (arXiv 2104.04473, §5.1, Table 1): V = 51,200, s = 2048,
  4h GeLU MLP, learned positions, embedding tied to the output layer (eq. 2 counts Vh once);
- Llama 2 70B and Llama 3 405B: chapter 1's `budget.MODELS` (Touvron et al. 2023; Llama Team 2024,
  arXiv 2407.21783, Table 3), sequence 8,192 for 405B (Table 4);
- DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437, §4.2): 61 layers, h = 7168, 128 heads, MLA
  (d_c = 512, d_c' = 1536, d_h = 128, d_h^R = 64), first 3 layers dense, then 1 shared and 256 routed
  experts of width 2048, 8 routed per token, s = 4096; vocabulary 129,280 (the released
  configuration; the report says "128K").
"""
import math
import functools
from dataclasses import dataclass

from labs.memory_budget import budget, compute


@dataclass(frozen=True)
class Weight:
    """One weight: ``shape`` as nn.Linear stores it (out, in), or (n,) for a vector; ``split`` how
    tensor parallelism cuts it ("col": dim 0, "row": dim 1, "kv": dim 0 by KV heads, "vocab": dim 0
    by vocabulary, "rep": whole on every rank); ``expert``: one of the routed experts' weights."""
    name: str
    shape: tuple
    split: str = "rep"
    expert: bool = False
    copies: int = 1      # the routed experts: one entry stands for all of them

    @property
    def numel(self):
        return self.copies * math.prod(self.shape)


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int          # L
    hidden: int          # h
    heads: int           # a
    kv_heads: int        # k_kv (= a without GQA)
    ffn: int             # MLP width: 4h for GPT's GeLU, f for SwiGLU
    vocab: int           # V
    seq: int             # s
    mlp: str = "swiglu"  # "gelu" (2 matrices, biases, LayerNorm) or "swiglu" (3, none, RMSNorm)
    tied: bool = False   # embedding shared with the output layer
    positions: bool = False   # a learned position table (s x h)
    experts: int = 0     # routed experts per MoE layer (0: dense model)
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0     # leading layers with a dense MLP (DeepSeek-V3: 3)
    mla: tuple = ()      # (d_c, d_c', d_h, d_h^R): multi-head latent attention (DeepSeek-V2/V3)

    def __hash__(self):   # the planner's caches key on the model: hash its name and main shapes only
        return hash((self.name, self.layers, self.hidden, self.vocab, self.seq, self.experts))

    @property
    def moe(self):
        return self.experts > 0

    @property
    def head_dim(self):
        return self.mla[2] if self.mla else self.hidden // self.heads

    @property
    def attention_width(self):
        """The h of the attention FLOPs (2s h per token for q k^T, 2s h for scores @ v, PaLM
        Appendix B): a d, or for MLA the mean of the query-key and value widths a (d_h + d_h^R) and a d_h."""
        if self.mla:
            d_c, d_q, d, d_r = self.mla
            return self.heads * (2 * d + d_r) // 2
        return self.hidden

    def is_moe_layer(self, i):
        return self.moe and i >= self.dense_layers

    def attention_weights(self):
        h, a, d = self.hidden, self.heads, self.head_dim
        if self.mla:   # DeepSeek-V2 §2.1.2 / V3 §2.1.1: down-projections whole, up-projections by heads
            d_c, d_q, d, d_r = self.mla
            return [Weight("wq_a", (d_q, h)), Weight("q_norm", (d_q,)), Weight("wq_b", (a * (d + d_r), d_q), "col"),
                    Weight("wkv_a", (d_c + d_r, h)), Weight("kv_norm", (d_c,)),
                    Weight("wkv_b", (a * 2 * d, d_c), "col"), Weight("wo", (h, a * d), "row")]
        if self.mlp == "gelu":   # the tiny GPT's and Megatron's fused qkv with biases
            return [Weight("qkv", (3 * h, h), "col"), Weight("qkv_bias", (3 * h,), "col"),
                    Weight("proj", (h, h), "row"), Weight("proj_bias", (h,))]
        kv = self.kv_heads * d
        return [Weight("wq", (a * d, h), "col"), Weight("wk", (kv, h), "kv"), Weight("wv", (kv, h), "kv"),
                Weight("wo", (h, a * d), "row")]

    def mlp_weights(self, width, expert=False, prefix="", copies=1):
        h = self.hidden
        if self.mlp == "gelu":
            return [Weight(prefix + "fc", (width, h), "col", expert, copies),
                    Weight(prefix + "fc_bias", (width,), "col", expert, copies),
                    Weight(prefix + "fc2", (h, width), "row", expert, copies),
                    Weight(prefix + "fc2_bias", (h,), "rep", expert, copies)]
        return [Weight(prefix + "w1", (width, h), "col", expert, copies),
                Weight(prefix + "w3", (width, h), "col", expert, copies),
                Weight(prefix + "w2", (h, width), "row", expert, copies)]

    @functools.lru_cache(maxsize=None)
    def layer_weights(self, i):
        """Layer ``i``'s weights (the routed experts as one entry per matrix, ``copies`` = experts);
        a tuple, cached: the planner asks for it for every layout."""
        h = self.hidden
        norms = ([Weight("ln1", (h,)), Weight("ln1_bias", (h,)), Weight("ln2", (h,)), Weight("ln2_bias", (h,))]
                 if self.mlp == "gelu" else [Weight("attention_norm", (h,)), Weight("ffn_norm", (h,))])
        out = norms + self.attention_weights()
        if not self.is_moe_layer(i):
            return tuple(out + self.mlp_weights(self.ffn))
        out.append(Weight("router", (self.experts, h)))
        if self.shared_experts:
            out += self.mlp_weights(self.shared_experts * self.expert_ffn, prefix="shared_")
        return tuple(out + self.mlp_weights(self.expert_ffn, expert=True, prefix="experts_", copies=self.experts))

    def embedding_weights(self):
        out = [Weight("embedding", (self.vocab, self.hidden), "vocab")]
        return out + ([Weight("positions", (self.seq, self.hidden))] if self.positions else [])

    def head_weights(self):
        norm = [Weight("final_norm", (self.hidden,))] + ([Weight("final_norm_bias", (self.hidden,))]
                                                          if self.mlp == "gelu" else [])
        return norm + ([] if self.tied else [Weight("head", (self.vocab, self.hidden), "vocab")])

    @functools.lru_cache(maxsize=None)
    def block_matmul_params(self, i):
        """The matmul weights one token meets in layer ``i``: every matrix but the routed experts
        it is not sent to (k of the ``experts``) and the vectors (norms, biases)."""
        ws = [w for w in self.layer_weights(i) if len(w.shape) == 2]
        routed = sum(w.numel for w in ws if w.expert)
        return sum(w.numel for w in ws if not w.expert) + (routed // self.experts * self.top_k if routed else 0)

    def params(self):
        """Total parameters, from the weights."""
        return (sum(w.numel for i in range(self.layers) for w in self.layer_weights(i))
                + sum(w.numel for w in self.embedding_weights() + self.head_weights()))

    # --- matmul weights a token meets: FLOPs (chapter 1, PaLM Appendix B) ---------------------
    def matmul_params(self):
        """P_mm of chapter 1: every layer's active matmul weights and the output layer (h V)."""
        return sum(self.block_matmul_params(i) for i in range(self.layers)) + self.hidden * self.vocab

    def active_params(self):
        """Parameters a token uses: the matmul weights, the vectors, and the embedding row (counted
        as V h, as the papers do)."""
        vectors = sum(w.numel for i in range(self.layers) for w in self.layer_weights(i) if len(w.shape) == 1)
        return self.matmul_params() + vectors + self.vocab * self.hidden * (0 if self.tied else 1)


def from_arch(name, arch, seq):
    """A chapter-1 `budget.MODELS` entry (Llama shapes) as a ModelShape."""
    return ModelShape(name, arch.layers, arch.hidden, arch.heads, arch.kv_heads, arch.ffn, arch.vocab, seq)


def gpt(name, layers, hidden, heads, vocab=51_200, seq=2048):
    """A GPT of Narayanan et al. 2021, Table 1: 4h GeLU MLP, biases, learned positions, tied embedding."""
    return ModelShape(name, layers, hidden, heads, heads, 4 * hidden, vocab, seq, mlp="gelu", tied=True,
                      positions=True)


def from_gpt_config(cfg):
    """The book's tiny GPT (`labs.model.GPTConfig`): untied head without bias, learned positions."""
    return ModelShape("tiny GPT", cfg.n_layer, cfg.hidden, cfg.n_head, cfg.n_head, 4 * cfg.hidden, cfg.vocab_size,
                      cfg.seq_len, mlp="gelu", tied=False, positions=True)


LLAMA2_70B = from_arch("Llama 2 70B", budget.MODELS["70B"], 4096)
LLAMA3_405B = from_arch("Llama 3 405B", budget.MODELS["405B"], 8192)
DEEPSEEK_V3 = ModelShape("DeepSeek-V3", layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432, vocab=129_280,
                         seq=4096, experts=256, top_k=8, expert_ffn=2048, shared_experts=1, dense_layers=3,
                         mla=(512, 1536, 128, 64))


def llama_params_agree(shape):
    """The weight list against chapter 1's count of a Llama block (`compute.llama_block_params`)."""
    block = compute.llama_block_params(shape.hidden, shape.heads, shape.kv_heads, shape.ffn)["total"]
    return sum(w.numel for w in shape.layer_weights(0)) == block


@dataclass(frozen=True)
class Cluster:
    """A GPU generation and its links; bandwidths in bytes per second, one direction, per GPU."""
    name: str
    generation: str      # the key of the efficiency calibration (one constant per generation)
    gpus_per_node: int
    hbm_bytes: float     # what one GPU holds
    intra_bw: float      # NVLink inside the node
    inter_bw: float      # the network port of each GPU
    peak_flops: float    # dense BF16 tensor-core peak


GIB = 2 ** 30
# Selene (Narayanan et al. 2021, §5): DGX A100 nodes of 8 x A100 80GB on NVLink 3 / NVSwitch (12
# links x 25 GB/s = 300 GB/s per direction: NVIDIA A100 whitepaper's 600 GB/s both ways), eight
# 200 Gb/s HDR InfiniBand adapters per node (one per GPU: 25 GB/s), peak 312 TFLOP/s in 16 bits.
SELENE = Cluster("Selene, DGX A100 80GB", "A100", 8, 80 * GIB, 300e9, 200e9 / 8, 312e12)
# Llama 3 (Llama Team 2024, §3.3.1): 8 x H100 80GB HBM3 per server on NVLink (chapter 11's 450 GB/s
# per direction), RoCE at 400 Gb/s per GPU; peak 989 TFLOP/s (chapter 1's H100 SXM dense BF16).
LLAMA3_CLUSTER = Cluster("Llama 3, H100 80GB", "H100", 8, 80 * GIB, 450e9, 400e9 / 8, compute.H100_BF16_DENSE)
DGX_H100 = Cluster("DGX H100", "H100", 8, 80 * GIB, 450e9, 400e9 / 8, compute.H100_BF16_DENSE)
# DeepSeek-V3 (§3.1, §3.2.2): 8 x H800 per node, NVLink 160 GB/s and InfiniBand 50 GB/s as the report
# gives them; the H800 is the H100's chip with fewer NVLinks, so its peak is taken to be the H100's.
H800_CLUSTER = Cluster("DeepSeek-V3, H800", "H100", 8, 80 * GIB, 160e9, 50e9, compute.H100_BF16_DENSE)
