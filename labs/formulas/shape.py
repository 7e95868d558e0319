"""Chapter 1: a model as its published shapes and the weight matrices they make; the one model type.

A model is its published shapes: layers L, hidden h, heads a, KV heads, MLP width, vocabulary V and
the sequence s it is trained at; a head width other than h/a where the model has one (Qwen3: 64 heads
of 128 on h = 4,096), the MLP's kind (SwiGLU's three matrices, or two: GeLU, ReLU, squared ReLU),
biases, and for a mixture of experts the routed and shared experts. `ModelShape.layer_weights` lists every
weight a layer, the embedding and the head hold, with the way tensor parallelism splits it (Shoeybi et al.
2019, §3: q, k, v and the first MLP matrix by columns, the output projections by rows, the vocabulary by rows
of the embedding and of the head); the parameter count, the matmul weights a token meets (chapter 1's
FLOPs) and what one rank of a layout holds (chapter 14's planner) are read from that list, and
nothing else counts parameters. A Llama block's list agrees with `compute.llama_block_params`
(checked in tests/test_planning.py); a GPT block is 12h^2 + 13h (Narayanan et al. 2021, eq. 2).

Every chapter that needs a model's shapes takes a `ModelShape`: chapter 1's `budget.MODELS`,
chapter 11's traffic calculator (`labs.hardware.placement`), chapter 14's planner
(`labs.formulas.planning.shapes` adds the GPT-3 family of Narayanan et al. 2021, DeepSeek-V3 and clusters).
"""
import functools
import math
from dataclasses import dataclass

MLPS = ("swiglu", "gelu", "relu", "squared_relu")

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
    # "swiglu" (3 matrices) or two: "gelu" (Megatron's GPT: fused qkv), "relu", "squared_relu"
    mlp: str = "swiglu"
    tied: bool = False   # embedding shared with the output layer
    positions: bool = False   # a learned position table (s x h)
    experts: int = 0     # routed experts per MoE layer (0: dense model)
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0     # leading layers with a dense MLP (DeepSeek-V3: 3)
    mla: tuple = ()      # (d_c, d_c', d_h, d_h^R): multi-head latent attention (DeepSeek-V2/V3)
    head_width: int = 0  # d of a head; 0: h / a
    bias: bool = None    # biases in the linear layers and norms; None: GPT's "gelu" has them, others not

    def __post_init__(self):
        if self.mlp not in MLPS:
            raise ValueError(f"mlp must be one of {', '.join(MLPS)}, got {self.mlp!r}.")
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {field} must be a positive whole number, got {value!r}.")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: the {self.kv_heads} KV heads must divide the {self.heads} query "
                             "heads (grouped-query attention shares each KV head among a group).")
        if not (self.head_width or self.mla) and self.hidden % self.heads:
            raise ValueError(f"{self.name}: the {self.heads} heads must divide the hidden size "
                             f"{self.hidden} (or give the head width).")
        if self.experts < 0 or not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"{self.name}: experts ({self.experts}) cannot be negative, nor the dense "
                             f"layers ({self.dense_layers}) outside 0..{self.layers}.")
        if self.experts and not (1 <= self.top_k <= self.experts and self.expert_ffn >= 1):
            raise ValueError(f"{self.name}: each token goes to top-k of the {self.experts} experts: top-k "
                             f"must be 1..{self.experts} (got {self.top_k}) and the expert width "
                             f"positive (got {self.expert_ffn}).")
        if self.bias is None:
            object.__setattr__(self, "bias", self.mlp == "gelu")

    def __hash__(self):   # the planner's caches key on the model: hash its name and main shapes only
        return hash((self.name, self.layers, self.hidden, self.vocab, self.seq, self.experts,
                     self.head_width))

    @property
    def moe(self):
        return self.experts > 0

    @property
    def head_dim(self):
        return self.mla[2] if self.mla else self.head_width or self.hidden // self.heads

    @property
    def two_matrix_mlp(self):
        return self.mlp != "swiglu"

    @property
    def attention_width(self):
        """The h of the attention FLOPs (2s h per token for q k^T, 2s h for scores @ v, PaLM
        Appendix B): a d (h, unless the heads are wider), or for MLA the mean of the query-key and
        value widths a (d_h + d_h^R) and a d_h."""
        if self.mla:
            d_c, d_q, d, d_r = self.mla
            return self.heads * (2 * d + d_r) // 2
        return self.heads * self.head_dim

    def is_moe_layer(self, i):
        return self.moe and i >= self.dense_layers

    def attention_weights(self):
        h, a, d = self.hidden, self.heads, self.head_dim
        if self.mla:   # DeepSeek-V2 §2.1.2 / V3 §2.1.1: down-projections whole, up-projections by heads
            d_c, d_q, d, d_r = self.mla
            return [Weight("wq_a", (d_q, h)), Weight("q_norm", (d_q,)),
                    Weight("wq_b", (a * (d + d_r), d_q), "col"), Weight("wkv_a", (d_c + d_r, h)),
                    Weight("kv_norm", (d_c,)), Weight("wkv_b", (a * 2 * d, d_c), "col"),
                    Weight("wo", (h, a * d), "row")]
        if self.mlp == "gelu" and self.kv_heads == a:   # the tiny GPT's and Megatron's fused qkv
            out = [Weight("qkv", (3 * h, h), "col"), Weight("proj", (h, h), "row")]
            biases = [Weight("qkv_bias", (3 * h,), "col"), Weight("proj_bias", (h,))]
            return out + (biases if self.bias else [])
        kv = self.kv_heads * d
        out = [Weight("wq", (a * d, h), "col"), Weight("wk", (kv, h), "kv"), Weight("wv", (kv, h), "kv"),
               Weight("wo", (h, a * d), "row")]
        return out + ([Weight("q_bias", (a * d,), "col"), Weight("k_bias", (kv,), "kv"),
                       Weight("v_bias", (kv,), "kv"), Weight("o_bias", (h,))] if self.bias else [])

    def mlp_weights(self, width, expert=False, prefix="", copies=1):
        h = self.hidden
        if self.two_matrix_mlp:
            out = [Weight(prefix + "fc", (width, h), "col", expert, copies),
                   Weight(prefix + "fc2", (h, width), "row", expert, copies)]
            return out + ([Weight(prefix + "fc_bias", (width,), "col", expert, copies),
                           Weight(prefix + "fc2_bias", (h,), "rep", expert, copies)] if self.bias else [])
        return [Weight(prefix + "w1", (width, h), "col", expert, copies),
                Weight(prefix + "w3", (width, h), "col", expert, copies),
                Weight(prefix + "w2", (h, width), "row", expert, copies)]

    @functools.lru_cache(maxsize=None)
    def layer_weights(self, i):
        """Layer ``i``'s weights (the routed experts as one entry per matrix, ``copies`` = experts);
        a tuple, cached: the planner asks for it for every layout."""
        h = self.hidden
        norms = ([Weight("ln1", (h,)), Weight("ln1_bias", (h,)), Weight("ln2", (h,)),
                  Weight("ln2_bias", (h,))]
                 if self.bias else [Weight("attention_norm", (h,)), Weight("ffn_norm", (h,))])
        out = norms + self.attention_weights()
        if not self.is_moe_layer(i):
            return tuple(out + self.mlp_weights(self.ffn))
        out.append(Weight("router", (self.experts, h)))
        if self.shared_experts:
            out += self.mlp_weights(self.shared_experts * self.expert_ffn, prefix="shared_")
        return tuple(out + self.mlp_weights(self.expert_ffn, expert=True, prefix="experts_",
                                            copies=self.experts))

    def embedding_weights(self):
        out = [Weight("embedding", (self.vocab, self.hidden), "vocab")]
        return out + ([Weight("positions", (self.seq, self.hidden))] if self.positions else [])

    def head_weights(self):
        norm = [Weight("final_norm", (self.hidden,))] + ([Weight("final_norm_bias", (self.hidden,))]
                                                          if self.bias else [])
        return norm + ([] if self.tied else [Weight("head", (self.vocab, self.hidden), "vocab")])

    @functools.lru_cache(maxsize=None)
    def block_matmul_params(self, i):
        """The matmul weights one token meets in layer ``i``: every matrix but the routed experts
        it is not sent to (k of the ``experts``) and the vectors (norms, biases)."""
        ws = [w for w in self.layer_weights(i) if len(w.shape) == 2]
        routed = sum(w.numel for w in ws if w.expert)
        active = routed // self.experts * self.top_k if routed else 0
        return sum(w.numel for w in ws if not w.expert) + active

    def layer_params(self, i=0):
        """Parameters of layer ``i`` (every routed expert included)."""
        return sum(w.numel for w in self.layer_weights(i))

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
