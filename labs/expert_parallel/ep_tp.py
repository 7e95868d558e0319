"""Chapter 7: expert parallelism beside tensor parallelism, folded over the same ranks.

Megatron Core's MoE parallel folding (Liu et al. 2025, arXiv 2504.14960; Megatron-LM's
megatron/core/transformer/moe/README.md) gives attention and MoE layers separate groups over the
same GPUs: TP x CP x DP x PP for attention, ETP x EP x EDP x PP for the experts, with expert tensor
parallelism ETP = 1 recommended for fine-grained experts. DeepSeek-V3 serves its prefill stage the
same way (technical report, section 3.4.1): attention with TP4 and sequence parallelism times DP8,
the MoE part with EP32, on the same 32 GPUs (it trains without TP, section 3.2).

The lab: one transformer block (`labs.model.Block`, its MLP replaced by the MoE layer) on tp x dp
ranks. The attention is split by chapter 4's Megatron TP with chapter 6's sequence parallelism
(`sp_layers`: all-gather of the s/tp tokens before the qkv product, reduce-scatter after the output
projection), and the MoE layer by expert parallelism over all tp * dp ranks (ep = tp * dp, etp = 1,
edp = 1). Sequence parallelism leaves each rank of a TP pair with its own s/tp tokens, so they go
straight into the all-to-all and no token is dispatched twice. Gradients: the attention shards'
over dp; the LayerNorms', the output projection's bias and the router's (each rank saw its own
tokens) over every rank; each expert lives on one rank and needs none.
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from labs import groups, model as tiny
from labs.dims import ParallelDims
from labs.context_parallel import sp_layers
from labs.data_parallel import hand_ring
from labs.expert_parallel import moe
from labs.launcher import launch
from labs.measure import comm
from labs.tensor_parallel import blocks as tp_blocks, megatron


class TokenMoE(nn.Module):
    """An MoE layer (no residual: the block adds it) on (B, s, h) activations, token by token."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):                                      # (B, s, h)
        return self.layer(x.reshape(-1, x.shape[-1])).view_as(x)


def block(hidden, n_head, seq, experts, top_k, seed):
    cfg = tiny.GPTConfig(hidden=hidden, n_head=n_head, seq_len=seq)
    torch.manual_seed(seed)
    b = tiny.Block(cfg)
    b.mlp = TokenMoE(moe.MoE(hidden, experts, top_k, None, seed=seed, residual=False))
    return b, cfg


def parallelize(b, tp_group, ep_group=None):
    """The attention by TP + SP over ``tp_group`` (chapter 6's layers), the MoE by EP over ``ep_group``."""
    t, rank, h = dist.get_world_size(tp_group), dist.get_rank(tp_group), b.attn.proj.in_features
    qkv = megatron.qkv_rows(h, b.attn.n_head, t, rank)
    b.attn.qkv = sp_layers.ColumnParallelLinear(b.attn.qkv, tp_group, qkv)
    b.attn.proj = sp_layers.RowParallelLinear(b.attn.proj, tp_group, qkv[:h // t])
    b.attn.n_head //= t
    b.mlp = TokenMoE(moe.ExpertParallelMoE(b.mlp.layer, group=ep_group))
    return b


def check(rank, world_size, tp=2, batch=2, seq=8, hidden=16, n_head=4, experts=8, top_k=2, seed=0):
    """The folded block beside one process on all ranks' data. Rank (d, j) holds sequences
    d*batch ... of the reference batch, tokens j*s/tp ... Returns errors (output, input gradient,
    every parameter gradient) and the bytes per group: TP's all-gathers and reduce-scatters and
    the gradient all-reduces counted as messages (hand rings), the all-to-alls' payloads."""
    grid = groups.Groups(ParallelDims.build(world_size, tp=tp))
    d, j, dev = grid.coords["dp"], grid.coords["tp"], launch.device()
    ref, cfg = block(hidden, n_head, seq, experts, top_k, seed)
    ref = ref.to(dev)
    g = torch.Generator().manual_seed(seed + 1)
    dp = world_size // tp
    x_all, up = (torch.randn(dp * batch, seq, hidden, generator=g).to(dev) for _ in range(2))  # (dp*B, s, h)
    x_ref = x_all.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * up).sum().backward()
    out_ref = out_ref.detach()
    b = parallelize(block(hidden, n_head, seq, experts, top_k, seed)[0].to(dev), grid.tp)
    rows, toks = slice(d * batch, (d + 1) * batch), slice(j * seq // tp, (j + 1) * seq // tp)
    x = x_all[rows, toks].clone().requires_grad_()                                      # (B, s/tp, h)
    with hand_ring.hand_collectives(), comm.counting() as tally, megatron.payloads() as tp_log, \
            moe.payloads() as ep_log:
        out = b(x)
        (out * up[rows, toks]).sum().backward()
    with hand_ring.hand_collectives():
        with comm.counting() as dp_tally:                      # the attention shards: over dp
            for p in (b.attn.qkv.weight, b.attn.qkv.bias, b.attn.proj.weight):
                comm.all_reduce(p.grad, group=grid.dp)
        with comm.counting() as all_tally:                     # each rank's own tokens: over every rank
            for p in (*b.ln1.parameters(), *b.ln2.parameters(), b.attn.proj.bias, b.mlp.layer.router.weight):
                comm.all_reduce(p.grad)
    errs = {}
    full = dict(ref.named_parameters())
    for name, p in b.named_parameters():
        if name.startswith("mlp.layer.experts."):
            i, rest = name.split(".", 4)[3], name.split(".", 4)[4]
            want = full[f"mlp.layer.experts.{int(i) + b.mlp.layer.rank * b.mlp.layer.per}.{rest}"].grad
        elif name.startswith("attn."):
            want = tp_blocks.slice_of_full(name[len("attn."):], full[name].grad, tp, j, "attention", cfg)
        else:
            want = full[name].grad
        errs[name] = (p.grad - want).abs().max().item()
    errs["input"] = (x.grad - x_ref.grad[rows, toks]).abs().max().item()
    a2a = sum(bytes_ for e in ep_log if e["what"] != "splits" for dst, bytes_ in enumerate(e["to"])
              if dst != rank)
    return {"max_abs_error": (out - out_ref[rows, toks]).abs().max().item(), "grad_errors": errs,
            "max_abs_error_grad": max(errs.values()),
            "tp_ops": [c["op"] for c in tp_log], "tp_payloads": [c["bytes"] for c in tp_log],
            "tp_bytes_sent": sum(tally.ops[op]["bytes_sent"] for op in ("all_gather", "reduce_scatter")),
            "a2a_payload_bytes_sent": a2a,                     # dispatch and combine, forward and backward
            "a2a_calls": tally.calls("all_to_all"),
            "dp_bytes_sent": dp_tally.bytes_sent, "every_rank_bytes_sent": all_tally.bytes_sent,
            "tp_group": grid.tp_ranks, "dp_group": grid.dp_ranks,
            "tokens_dispatched": x.shape[0] * x.shape[1], "routing_margin": ref.mlp.layer.routing.margin}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Attention by TP + SP, the MoE by EP over the same ranks (MoE parallel folding), "
                   "against one process, bytes per group counted.", world_size_default=4)
    p.add_argument("--tp", type=cli.positive_int, default=2)
    args = cli.parse(p, argv)
    ParallelDims.build(args.world_size, tp=args.tp)
    megatron.check_degree(tiny.GPTConfig(hidden=16, n_head=4), args.tp)
    moe.check_ep(8, args.world_size)
    results = launch.launch(check, args.world_size, args.tp, timeout=args.timeout)
    if results is None:
        return
    r0 = results[0]
    result = {"max_abs_error": max(r["max_abs_error"] for r in results),
              "max_abs_error_grad": max(r["max_abs_error_grad"] for r in results),
              "tp_bytes_sent": r0["tp_bytes_sent"],
              "a2a_payload_bytes_sent": [r["a2a_payload_bytes_sent"] for r in results],
              "world_size": len(results), "tp": args.tp}
    cli.report(result, args, f"folded TP{args.tp} attention + EP{len(results)} MoE: max error "
               f"{result['max_abs_error']:.1e} (grads {result['max_abs_error_grad']:.1e}); TP bytes "
               f"sent per rank {r0['tp_bytes_sent']} (counted), all-to-all payloads "
               f"{result['a2a_payload_bytes_sent']}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
