"""One tiny GPT-style transformer, used by every chapter.

A GPT-2/Megatron block (pre-LayerNorm, attention written out by hand, 4h GeLU MLP, dropout),
shaped so that Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", arXiv 2205.05198) describes its activation memory exactly. Parallelism is applied to a
built model from outside (``apply_<technique>(model, groups)`` in each lab), never by branches
in ``forward``.

Symbols: batch b, sequence s, hidden h, heads a, layers L, vocabulary V.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 64   # V
    seq_len: int = 16      # s (the longest sequence the position table holds)
    n_layer: int = 2       # L
    n_head: int = 4        # a
    hidden: int = 32       # h
    dropout: float = 0.0   # 0 keeps every lab deterministic; chapter 1 turns it on to match the paper

    def __post_init__(self):
        if self.hidden % self.n_head:
            raise ValueError(f"hidden={self.hidden} is not divisible by n_head={self.n_head}; "
                             "choose a hidden size that is a multiple of the head count.")


class Dropout(nn.Module):
    """Dropout that keeps a 1-byte mask for backward on every device.

    ``nn.Dropout`` on the CPU saves a noise tensor in the activation dtype (2 bytes per element in
    bf16); the fused CUDA kernel, and this module everywhere, save a bool mask, which is what the
    activation-memory formula assumes.
    """

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        return torch.native_dropout(x, self.p, True)[0]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_drop = Dropout(cfg.dropout)
        # Additive mask: adding saves nothing for backward, unlike masked_fill, which keeps its mask.
        mask = torch.full((cfg.seq_len, cfg.seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        # Widths come from the tensors, not the config: under tensor parallelism this module sees
        # only its rank's heads (n_head / tp of them, and 3h / tp columns of qkv); under sequence
        # parallelism x holds s/tp tokens and qkv's output all s of them, so T is read from that.
        q, k, v = self.qkv(x).chunk(3, dim=2)                     # 3 x (B, T, a*d)
        B, T, _ = q.shape
        d = q.size(-1) // self.n_head
        q, k, v = (t.view(B, T, self.n_head, d).transpose(1, 2) for t in (q, k, v))  # (B, a, T, d)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))    # (B, a, T, T)
        att = (att + self.mask[:T, :T].to(att.dtype)).softmax(dim=-1)
        y = self.attn_drop(att) @ v                               # (B, a, T, d)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)         # (B, T, a*d)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)    # A in Megatron's Z = GeLU(XA)B
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.hidden, cfg.hidden)  # B

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.drop1 = Dropout(cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)
        self.drop2 = Dropout(cfg.dropout)

    def forward(self, x):                                   # (B, T, H) -> (B, T, H)
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.cfg.seq_len}; "
                             "build the model with a larger seq_len.")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))  # (B, T, H)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))                                         # (B, T, V)
        if targets is None:
            return logits
        # The loss in fp32 whatever the model's dtype: a bf16 log-softmax loses the small terms.
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def build(cfg=None, seed=0, dtype=torch.float32, device="cpu"):
    """The same initial weights on every rank that passes the same seed."""
    torch.manual_seed(seed)
    return GPT(cfg or GPTConfig()).to(device=device, dtype=dtype)


def synthetic_batch(cfg, batch_size, seed, seq_len=None, device="cpu"):
    """Random tokens and next-token targets; rank r passes seed=r to get its own shard of data."""
    g = torch.Generator().manual_seed(seed)
    T = seq_len or cfg.seq_len
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, T + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def num_params(model):
    return sum(p.numel() for p in model.parameters())


# --- a tiny Llama-style block (chapter 1's Llama activation formula is proven on it) -----------

@dataclass
class LlamaConfig:
    """Llama 2 block shapes in miniature (Touvron et al. 2023, arXiv 2307.09288, §2.2 and Table 1).

    No biases, no dropout, RMSNorm, rotary positions (RoPE), grouped-query attention (GQA:
    ``n_head / n_kv_head`` query heads share one key/value head) and a SwiGLU MLP of width ``ffn``.
    """
    hidden: int = 32          # h
    n_head: int = 4           # a, query heads
    n_kv_head: int = 2        # key/value heads (Llama 2 70B: 64 query heads, 8 KV heads)
    ffn: int = 88             # f, SwiGLU width (7B: 11008 = 2.6875 h)
    seq_len: int = 16         # s, the longest sequence the RoPE and mask tables hold
    rope: bool = True
    attention: str = "sdpa"   # "sdpa": F.scaled_dot_product_attention; "materialized": scores written out
    eps: float = 1e-5

    def __post_init__(self):
        if self.attention not in ("sdpa", "materialized"):
            raise ValueError(f"attention must be 'sdpa' or 'materialized', got {self.attention!r}.")
        if self.hidden % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"hidden={self.hidden}, n_head={self.n_head}, n_kv_head={self.n_kv_head}: "
                             "n_head must divide hidden and n_kv_head must divide n_head.")
        if self.rope and (self.hidden // self.n_head) % 2:
            raise ValueError(f"RoPE rotates pairs of features, so the head size {self.hidden // self.n_head} "
                             "must be even.")


class _RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) * w, saving only what a fused kernel saves: the input x and 1/rms per token (fp32).

    The unfused reference (Meta's ``RMSNorm``, and ``F.rms_norm`` on a CPU, which decomposes into
    pow/mean/rsqrt/mul) saves an fp32 copy of x and the fp32 normalized x as well: 8 bytes per
    element more. Fused kernels (Apex, Transformer Engine) keep x and 1/rms, as here.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))     # bf16 -> fp32, as Llama's .float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)   # (B, T, 1), fp32
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd                                # recomputed, not stored
        g = grad.to(rstd.dtype) * weight.to(rstd.dtype)
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = (grad.to(rstd.dtype) * xhat.to(x.dtype)).sum(dim=tuple(range(grad.dim() - 1)))
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019 (arXiv 1910.07467): x / sqrt(mean(x^2) + eps) * w, no mean, no bias."""

    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return _RMSNormFn.apply(x, self.weight, self.eps)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def repeat_kv(x, n_rep):
    """(B, kv, T, d) -> (B, kv * n_rep, T, d): each KV head serves n_rep query heads, as a copy.

    ``repeat_interleave`` always copies; the expand-then-reshape of Meta's reference is a free view
    in one corner (one KV head, b = 1) and a copy otherwise, which no simple formula follows.
    """
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.attention = cfg.n_head, cfg.n_kv_head, cfg.attention
        d = cfg.hidden // cfg.n_head
        self.wq = nn.Linear(cfg.hidden, cfg.n_head * d, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.n_kv_head * d, bias=False)   # separate q, k, v: a saved
        self.wv = nn.Linear(cfg.hidden, cfg.n_kv_head * d, bias=False)   # view of a fused qkv output
        self.wo = nn.Linear(cfg.n_head * d, cfg.hidden, bias=False)      # would keep all three alive
        self.rope = cfg.rope
        if cfg.rope:  # Su et al. 2021 (arXiv 2104.09864), the rotate-half form; buffers, not activations
            inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
            angles = torch.outer(torch.arange(cfg.seq_len).float(), inv_freq).repeat(1, 2)  # (s, d)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
        mask = torch.full((cfg.seq_len, cfg.seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def _rotate(self, t, T):
        # multiplying by a buffer saves only the buffer: RoPE adds no activation bytes
        return t * self.cos[:T] + _rotate_half(t) * self.sin[:T]

    def core(self, q, k, v):
        """softmax(q k^T / sqrt(d)) v, causal: (B, a, T, d), (B, kv, T, d) x 2 -> (B, a, T, d)."""
        if self.attention == "sdpa":  # a fused kernel: keeps q, k, v, the output and log-sum-exp
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))
        n_rep = q.size(1) // k.size(1)
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)                 # copies, a heads each
        T = q.size(2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, a, T, T)
        att = (att + self.mask[:T, :T].to(att.dtype)).softmax(dim=-1)   # saved: s x s per head
        return att @ v

    def forward(self, x):
        B, T, _ = x.shape
        d = self.wq.out_features // self.n_head
        q = self.wq(x).view(B, T, -1, d).transpose(1, 2)                # (B, a, T, d)
        k = self.wk(x).view(B, T, -1, d).transpose(1, 2)                # (B, kv, T, d)
        v = self.wv(x).view(B, T, -1, d).transpose(1, 2)                # (B, kv, T, d)
        if self.rope:
            q, k = self._rotate(q, T), self._rotate(k, T)
        y = self.core(q, k, v)                                          # (B, a, T, d)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))             # (B, T, h)


class SwiGLU(nn.Module):
    """Shazeer 2020 (arXiv 2002.05202): w2(SiLU(x w1) * (x w3)), Llama's names for the three matrices."""

    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # gate
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.attn = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x):                                   # (B, T, h) -> (B, T, h)
        if x.size(1) > self.attn.mask.size(0):
            raise ValueError(f"sequence of {x.size(1)} tokens is longer than "
                             f"seq_len={self.attn.mask.size(0)}; "
                             "build the block with a larger seq_len.")
        x = x + self.attn(self.attention_norm(x))
        return x + self.mlp(self.ffn_norm(x))
