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
        # only its rank's heads (n_head / tp of them, and 3h / tp columns of qkv).
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)                     # 3 x (B, T, a*d)
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
