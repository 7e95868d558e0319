"""Chapter 4: grouped-query attention under tensor parallelism, KV heads split or replicated.

GQA (Ainslie et al. 2023, arXiv 2305.13245) gives a query heads only k key/value heads: query head
j reads KV head j // (a/k). Megatron's head split (Shoeybi et al. 2019, §3) hands each of tp ranks
a/tp query heads, which must find their KV heads on the same rank:
- k % tp == 0: split, k/tp KV heads per rank (Llama 2 70B, k = 8, at tp = 8: one each);
- tp % k == 0: replicate, one KV head per rank, each held by tp/k ranks (k = 8 at tp = 16). The
  copies' gradients are partial (each from its own a/tp query heads) and must be summed over the
  tp/k ranks that hold the copy: one more all-reduce of d x h per K and V weight;
- otherwise neither of these two layouts fits, and the lab refuses tp (other layouts exist, e.g.
  a = 24, k = 6, tp = 4: each rank reads 2 whole KV heads, some held by two ranks; Megatron-Core
  itself requires tp to divide k).

    python -m labs.tensor_parallel.gqa_parallel --world-size 2 --kv-heads 1 --json
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from labs.measure import comm
from labs.launcher import launch
from labs import model as tiny
from labs.tensor_parallel import megatron
from labs.formulas.tensor_parallel import (  # the formulas' home is the torch-free core
    kv_heads_of as kv_heads_of, kv_layout as kv_layout)


class TensorParallelAttention(nn.Module):
    """f, then this rank's query and KV heads (plain linears), then wo row-parallel (g inside)."""

    def __init__(self, attn, group):
        super().__init__()
        self.attn, self.group = attn, group

    def forward(self, x):
        return self.attn(megatron._F.apply(x, self.group))  # one f for wq, wk and wv: they share the input


def _rows(heads, d):
    return torch.cat([torch.arange(j * d, (j + 1) * d) for j in heads])


def parallelize_gqa(attn, group=None):
    """Turn a `labs.model.LlamaAttention` into its tensor-parallel version; returns (module, layout)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    lay = kv_layout(attn.n_head, attn.n_kv_head, tp)
    d = attn.wq.out_features // attn.n_head
    q_rows = torch.arange(rank * lay["q_heads_per_rank"] * d, (rank + 1) * lay["q_heads_per_rank"] * d)
    kv_rows = _rows(kv_heads_of(rank, attn.n_kv_head, tp), d)
    for name, rows in (("wq", q_rows), ("wk", kv_rows), ("wv", kv_rows)):
        full = getattr(attn, name)
        local = nn.Linear(full.in_features, len(rows), bias=False)
        local.weight = nn.Parameter(full.weight.detach()[rows].clone())
        setattr(attn, name, local)
    attn.wo = megatron.RowParallelLinear(attn.wo, group, q_rows)
    attn.n_head, attn.n_kv_head = lay["q_heads_per_rank"], lay["kv_heads_per_rank"]
    return TensorParallelAttention(attn, group), lay


def copy_groups(n_kv_head, tp):
    """One process group per KV head: the ranks holding its copies (call on every rank, same order)."""
    return [dist.new_group([r for r in range(tp) if kv_heads_of(r, n_kv_head, tp) == [j]])
            for j in range(n_kv_head)]


def sum_replicated_kv_grads(module, n_kv_head, groups):
    """Replicate mode: add up the copies' partial gradients of wk and wv within each copy group."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    group = groups[kv_heads_of(rank, n_kv_head, tp)[0]]
    for lin in (module.attn.wk, module.attn.wv):
        comm.all_reduce(lin.weight.grad, group=group)


def check(rank, world_size, n_kv_head=1, n_head=12, hidden=48, b=2, s=8):
    """A TP GQA layer beside the unsharded one: output, input gradient and every weight gradient.

    Returns ``layout``, ``errors`` (max abs difference per tensor, after summing replicated KV
    gradients), ``kv_grad_error_unsummed`` (replicate mode: the copies' partial gradients against
    the full one, before the sum), ``kv_params`` (per rank, read from wk and wv, and unsharded) and
    ``allreduce_payloads`` (labs.measure.comm: forward, backward, and the replicated-KV gradient sum).
    """
    cfg = tiny.LlamaConfig(hidden=hidden, n_head=n_head, n_kv_head=n_kv_head, seq_len=s)
    dev = launch.device()
    torch.manual_seed(0)
    full = tiny.LlamaAttention(cfg).to(dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, hidden, generator=g).to(dev)
    upstream = torch.randn(b, s, hidden, generator=g).to(dev)
    x_ref = x.clone().requires_grad_()
    out_ref = full(x_ref)
    (out_ref * upstream).sum().backward()
    torch.manual_seed(0)
    module, lay = parallelize_gqa(tiny.LlamaAttention(cfg).to(dev), None)
    groups = copy_groups(n_kv_head, world_size) if lay["mode"] == "replicate" else None
    x_tp = x.clone().requires_grad_()
    with comm.counting() as fwd:
        out = module(x_tp)
    with comm.counting() as bwd:
        (out * upstream).sum().backward()
    d = hidden // n_head
    kv_rows = _rows(kv_heads_of(rank, n_kv_head, world_size), d)
    q_rows = torch.arange(rank * lay["q_heads_per_rank"] * d, (rank + 1) * lay["q_heads_per_rank"] * d)
    ref = {"wq": full.wq.weight.grad[q_rows], "wk": full.wk.weight.grad[kv_rows],
           "wv": full.wv.weight.grad[kv_rows], "wo": full.wo.weight.grad[:, q_rows]}
    mine = {"wq": module.attn.wq, "wk": module.attn.wk, "wv": module.attn.wv, "wo": module.attn.wo}
    unsummed = max((mine[k].weight.grad - ref[k]).abs().max().item() for k in ("wk", "wv"))
    with comm.counting() as kv_sum:
        if groups is not None:
            sum_replicated_kv_grads(module, n_kv_head, groups)
    errors = {k: (mine[k].weight.grad - ref[k]).abs().max().item() for k in mine}
    errors.update(output=(out - out_ref).abs().max().item(),
                  input=(x_tp.grad - x_ref.grad).abs().max().item())
    return {"layout": lay, "errors": errors, "kv_grad_error_unsummed": unsummed,
            "kv_params": {"per_rank": mine["wk"].weight.numel() + mine["wv"].weight.numel(),
                          "unsharded": full.wk.weight.numel() + full.wv.weight.numel()},
            "allreduce_payloads": {name: t.ops["all_reduce"]["payloads"] if t.calls("all_reduce") else []
                                   for name, t in (("forward", fwd), ("backward", bwd),
                                                   ("kv_grad_sum", kv_sum))}}


def check_many(rank, world_size, kv_heads=(1,), **kwargs):
    """`check` for several KV head counts in one job (one process start instead of one per count)."""
    return {k: check(rank, world_size, k, **kwargs) for k in kv_heads}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("GQA under tensor parallelism: KV heads split or replicated, against the unsharded layer.")
    p.add_argument("--kv-heads", type=cli.positive_int, default=1)
    p.add_argument("--heads", type=cli.positive_int, default=12)
    args = cli.parse(p, argv)
    kv_layout(args.heads, args.kv_heads, args.world_size)
    if args.heads % args.kv_heads or 48 % args.heads or (48 // args.heads) % 2:
        raise ValueError(f"--heads {args.heads} and --kv-heads {args.kv_heads} do not fit h = 48: "
                         "the KV heads must divide the heads, and the heads 48 into an even head size "
                         "(e.g. 12 heads).")
    results = launch.launch(check, args.world_size, args.kv_heads, args.heads, timeout=args.timeout)
    if results is None:
        return
    r = {"layout": results[0]["layout"], "max_error": max(max(x["errors"].values()) for x in results),
         "kv_params": results[0]["kv_params"], "world_size": len(results)}
    cli.report(r, args, f"GQA {args.heads} query / {args.kv_heads} KV heads on tp = {len(results)}: "
               f"{r['layout']['mode']}, max error {r['max_error']:.1e}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
