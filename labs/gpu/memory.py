"""Chapter 1 on a GPU: bytes kept for backward by one layer, and bytes per parameter of an Adam step.

Saved bytes: one `labs.model.Block` (GPT-3 shape: 4h GeLU MLP, 1-byte dropout masks, dropout 0.1)
in bf16, b = 1, measured with saved-tensor hooks (`labs.measure.memory.saved_for_backward`), with the
softmax written out and through ``F.scaled_dot_product_attention`` under each back-end, against
Korthikanti et al. 2022 (arXiv 2205.05198, Table 2) sbh(34 + 5as/h), and against 34sbh, what is
left when a fused kernel keeps no s x s tensor (FlashAttention, Dao et al. 2022, arXiv 2205.14135).

Adam step: ``memory_allocated`` after ``optimizer.step()`` and ``max_memory_allocated`` during it,
per parameter, against the 16 bytes of mixed-precision Adam (Rajbhandari et al. 2020, ZeRO,
arXiv 1910.02054, §3.1: 2 + 2 + 12) and a peak term derived from what each optimizer allocates
while it steps (`peak_term`).
"""
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from labs.memory_budget import activations, budget, recipes
from labs.measure import memory
from labs import model as tiny
from labs.gpu.figures import figure, refused, skipped

BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
            "math": "MATH"}


class SDPAAttention(tiny.CausalSelfAttention):
    """The lab's attention with the core handed to F.scaled_dot_product_attention (causal, same
    dropout); applied from outside by swapping the module's class, weights unchanged."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=2)                     # 3 x (B, T, a*d)
        B, T, _ = q.shape
        d = q.size(-1) // self.n_head
        q, k, v = (t.view(B, T, self.n_head, d).transpose(1, 2) for t in (q, k, v))  # (B, a, T, d)
        p = self.attn_drop.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)   # (B, a, T, d)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, -1))


def _saved_row(cfg, device, backend=None):
    """Saved bytes of one block's forward (b = 1), and the aten attention kernels that ran."""
    torch.manual_seed(0)
    block = tiny.Block(cfg).to(device=device, dtype=torch.bfloat16).train()
    if backend is not None:
        block.attn.__class__ = SDPAAttention
    x = torch.randn(1, cfg.seq_len, cfg.hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    with memory.saved_for_backward(block) as saved, activations.AttentionOps() as ops:
        if backend is None:
            block(x)
        else:
            with sdpa_kernel([getattr(SDPBackend, BACKENDS[backend])]):
                block(x)
    return {"bytes": saved.bytes, "by_dtype": saved.by_dtype(), "kernels": sorted(ops.ops)}


def _attempt(cfg, device, backend):
    """A back-end the build or GPU refuses is recorded with its reason (its warnings say why)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _saved_row(cfg, device, backend)
        except (RuntimeError, NotImplementedError) as exc:
            why = " | ".join(str(w.message) for w in caught)
            return refused(f"{exc} {why}")
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()


def saved_bytes(device, sizes):
    """Rows per (s, h): materialized softmax and SDPA per back-end, each against both formulas."""
    rows = []
    for s in sizes.act_seqs:
        for h in sizes.act_hiddens:
            a = h // sizes.head_dim
            cfg = tiny.GPTConfig(seq_len=s, hidden=h, n_head=a, dropout=0.1)
            kor = activations.gpt3_activation_bytes_per_layer(s, 1, h, a)
            flat = 34 * s * h
            stats = 2 * s * activations.layernorm_stat_bytes(h, torch.bfloat16, device)
            row = {"s": s, "h": h, "a": a, "b": 1, "layernorm_stats_bytes": stats,
                   "korthikanti": figure(kor, "bytes", "formula", "s*b*h*(34 + 5*a*s/h)", kor),
                   "sbh34": figure(flat, "bytes", "formula", "34*s*b*h", flat)}
            for name in ("materialized", *BACKENDS):
                got = _attempt(cfg, device, None if name == "materialized" else name)
                if isinstance(got, str):
                    row[name] = got
                    continue
                row[name] = figure(got["bytes"], "bytes", formula="s*b*h*(34 + 5*a*s/h)", formula_value=kor,
                                   ratio_korthikanti=got["bytes"] / kor, ratio_34sbh=got["bytes"] / flat,
                                   by_dtype=got["by_dtype"], kernels=got["kernels"])
            rows.append(row)
    return {"rows": rows, "note": "layernorm_stats_bytes: the two LayerNorms' mean and 1/std, which "
            "Korthikanti's count leaves out (labs.memory_budget.activations.measure_activations)"}


def gpt_200m(sizes):
    return tiny.GPTConfig(vocab_size=sizes.model_vocab, seq_len=sizes.model_seq, n_layer=sizes.model_layers,
                          n_head=sizes.model_heads, hidden=sizes.model_hidden)


def peak_term(variant, params):
    """Bytes per parameter each optimizer adds while it steps (temporaries alive at its peak):
    the lab's Adam (`labs.memory_budget.recipes.Adam`) loops over parameters and holds an fp32 copy of one
    gradient and the fp32 denominator sqrt(v / (1 - beta2^t)) of the same tensor: 8 bytes times
    the largest parameter; torch's foreach AdamW holds ``_foreach_sqrt(exp_avg_sqs)``, an fp32
    copy of v for all parameters at once: 4 bytes each; the fused kernel holds none: 0."""
    if variant == "lab_mixed":
        return 8 * max(p.numel() for p in params) / sum(p.numel() for p in params)
    return {"adamw_foreach": 4.0, "adamw_fused": 0.0}[variant]


def _optimizer(variant, net):
    if variant == "lab_mixed":
        return recipes.prepare(net, "mixed"), False                 # bf16 weights, no autocast
    fused = variant == "adamw_fused"
    return torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=not fused, fused=fused), True


def _one_variant(variant, cfg, sizes, device):
    """Two steps; for each, bytes above the start while ``optimizer.step()`` runs: CUDA's
    allocated and peak counters on a GPU, the live-storage high-water mark (`memory.PeakMemory`) anywhere."""
    cuda = device.type == "cuda"
    start = torch.cuda.memory_allocated(device) if cuda else 0
    net = tiny.build(cfg, device=device)
    opt, autocast = _optimizer(variant, net)
    params = list(net.parameters())
    P = sum(p.numel() for p in params)
    buffers = memory.storage_bytes(list(net.buffers()))                 # the attention masks
    x, y = tiny.synthetic_batch(cfg, sizes.model_batch, seed=0, device=device)
    steps = []
    for _ in range(2):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = net(x, y)
        loss.backward()
        del loss
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        with memory.PeakMemory(net, opt if autocast else opt.state_dict_tensors()) as mem:
            opt.step()
        step = {"live_storage_peak_per_param": (mem.peak_bytes - buffers) / P,
                "live_storage_end_per_param": (mem.end_bytes - buffers) / P}
        if cuda:
            torch.cuda.synchronize(device)
            step["after_per_param"] = (torch.cuda.memory_allocated(device) - start - buffers) / P
            step["peak_per_param"] = (torch.cuda.max_memory_allocated(device) - start - buffers) / P
        steps.append(step)
        opt.zero_grad()
    term = peak_term(variant, params)
    del net, opt, x, y, params
    return P, buffers, steps, term


def adam_step_memory(device, sizes):
    """Per parameter: after the step and the peak during it (CUDA counters; "skipped" on a CPU),
    and the live-storage peak (measured anywhere), beside 16 bytes and 16 + the peak term."""
    cfg, out = gpt_200m(sizes), {}
    state16 = budget.state_bytes_per_param(recipe="mixed")["total"]
    for variant in ("lab_mixed", "adamw_foreach", "adamw_fused"):
        P, buffers, steps, term = _one_variant(variant, cfg, sizes, device)
        v = {"params": P, "buffer_bytes_excluded": buffers, "peak_term_per_param": term}
        for i, step in enumerate(steps, 1):
            live = step["live_storage_peak_per_param"]
            v[f"step{i}_live_storage_peak"] = figure(live, "bytes/param", formula="16 + peak term",
                                                     formula_value=state16 + term)
            v[f"step{i}_live_storage_end"] = figure(step["live_storage_end_per_param"], "bytes/param",
                                                    formula="16", formula_value=state16)
            if "after_per_param" in step:
                v[f"step{i}_after"] = figure(step["after_per_param"], "bytes/param", formula="16",
                                             formula_value=state16)
                v[f"step{i}_peak"] = figure(step["peak_per_param"], "bytes/param", formula="16 + peak term",
                                            formula_value=state16 + term)
            else:
                v[f"step{i}_after"] = v[f"step{i}_peak"] = skipped(
                    "memory_allocated and max_memory_allocated are CUDA counters")
        out[variant] = v
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["model"] = {"layers": cfg.n_layer, "hidden": cfg.hidden, "heads": cfg.n_head, "vocab": cfg.vocab_size,
                    "seq": cfg.seq_len, "batch": sizes.model_batch}
    return out
