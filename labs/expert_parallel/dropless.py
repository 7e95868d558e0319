"""Chapter 7: dropless MoE (MegaBlocks) beside capacity-based dropping, equal to one process.

Capacity (GShard, Lepikhin et al. 2020, section 2.2; Switch, Fedus et al. 2021, section 2.2): every
expert gets a fixed buffer of C slots, the experts run as one batched product over N x C slots,
empty slots included, and a (token, expert) pair beyond C is dropped. Dropless (MegaBlocks, Gale et
al. 2022, arXiv 2211.15841): each expert computes the rows routed to it, a variable-sized batch, so
nothing is dropped; MegaBlocks writes the expert computation as block-sparse products for the GPU
and pads each expert's rows only up to a multiple of its block (megablocks/layers/dmoe.py:
``ops.round_up(tokens_per_expert, self.blocking)``, blocking = 128), not to a capacity. On a CPU the
same computation is a grouped GEMM, which pads nothing: one call
``torch._grouped_mm(x, w, offs=...)`` multiplies the rows of group g (between offsets) by w[g]
(torch 2.13 runs it on the CPU, in fp32 and with autograd). Where it is missing, `grouped_mm` falls
back to one product over a block-diagonal layout (group g's rows in columns g*h ... (g+1)*h),
which computes N times the FLOPs; `grouped_mm.last` names what ran.

`PaddedCapacityMoE` and `DroplessMoE` have `moe.MoE`'s interface and weights; the lab checks each
against `moe.MoE` (capacity, and no capacity) and counts the FLOPs with `FlopCounterMode`.
`GroupedExpertParallelMoE` runs each rank's experts of `moe.ExpertParallelMoE` the grouped way.
"""
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from labs.expert_parallel import moe, moe_check, moe_routing
from labs.launcher import launch


def grouped_mm(x, w, counts):
    """(R, a) rows grouped by ``counts`` (G,), w (G, a, b) -> (R, b): group g's rows times w[g]."""
    offs = counts.cumsum(0).to(torch.int32)
    if hasattr(torch, "_grouped_mm"):
        try:
            y = torch._grouped_mm(x, w, offs=offs)
            grouped_mm.last = "torch._grouped_mm"
            return y
        except (RuntimeError, NotImplementedError):
            pass
    g, a = w.shape[0], w.shape[1]
    group = torch.repeat_interleave(torch.arange(g, device=x.device), counts)             # (R,)
    bd = x.new_zeros(x.shape[0], g, a).scatter(1, group[:, None, None].expand(-1, 1, a), x[:, None, :])
    grouped_mm.last = "block-diagonal matmul"
    return bd.reshape(x.shape[0], g * a) @ w.reshape(g * a, -1)                            # one product


grouped_mm.last = None


def stacked(experts):
    """The experts' weights as (N, h, f), (N, f), (N, f, h), (N, h): one tensor per layer, for a
    grouped or batched product (gradients flow back to each expert's nn.Linear)."""
    w1 = torch.stack([ex[0].weight.t() for ex in experts])
    w2 = torch.stack([ex[2].weight.t() for ex in experts])
    return w1, torch.stack([ex[0].bias for ex in experts]), w2, torch.stack([ex[2].bias for ex in experts])


def grouped_experts(rows, counts, experts):
    """Every expert on its own contiguous group of rows (R, h), sizes ``counts``: two grouped GEMMs."""
    w1, b1, w2, b2 = stacked(experts)
    hid = F.gelu(grouped_mm(rows, w1, counts) + b1.repeat_interleave(counts, 0))
    return grouped_mm(hid, w2, counts) + b2.repeat_interleave(counts, 0)


class DroplessMoE(moe.MoE):
    """`moe.MoE` with no capacity and its experts run as one grouped GEMM over the pairs sorted by
    expert (MegaBlocks' dropless MoE, on a CPU)."""

    def forward(self, x):                                      # (T, h)
        r = self.decide(x)
        t, slot = r.keep.nonzero(as_tuple=True)
        e = r.idx[t, slot]
        o = torch.argsort(e, stable=True)
        t, slot = t[o], slot[o]
        y = grouped_experts(x[t], torch.bincount(e, minlength=self.num_experts), self.experts)
        out = torch.zeros_like(x).index_add(0, t, r.gates[t, slot, None] * y)
        return x + out if self.residual else out


class PaddedCapacityMoE(moe.MoE):
    """`moe.MoE` with a capacity, computed as GShard and Switch do: a buffer of C slots per expert,
    one batched product over all N x C slots, the empty ones included."""

    def forward(self, x):                                      # (T, h)
        r = self.decide(x)
        n, c, k = self.num_experts, self.capacity(x.shape[0]), self.top_k
        e = r.idx.t().reshape(-1)                              # (k*T,) choice-major, the router's priority
        onehot = F.one_hot(e, n)
        pos = (onehot.cumsum(0) * onehot).sum(-1) - 1          # place in its expert's queue
        t = torch.arange(x.shape[0], device=x.device).repeat(k)
        slot = torch.arange(k, device=x.device).repeat_interleave(x.shape[0])
        kept = pos < c
        buf = x.new_zeros(n, c, x.shape[1]).index_put((e[kept], pos[kept]), x[t[kept]])   # (N, C, h)
        w1, b1, w2, b2 = stacked(self.experts)
        y = torch.bmm(F.gelu(torch.bmm(buf, w1) + b1[:, None]), w2) + b2[:, None]       # (N, C, h)
        gates = r.gates[t[kept], slot[kept], None]
        out = torch.zeros_like(x).index_add(0, t[kept], gates * y[e[kept], pos[kept]])
        return x + out if self.residual else out


class GroupedExpertParallelMoE(moe.ExpertParallelMoE):
    """`moe.ExpertParallelMoE` whose rank runs its experts as one grouped GEMM (dropless)."""

    def run_experts(self, rows, local):
        o = torch.argsort(local, stable=True)
        y = grouped_experts(rows[o], torch.bincount(local, minlength=self.per), self.experts)
        return torch.zeros_like(rows).index_copy(0, o, y)


def check_grouped(rank, world_size, **kwargs):
    """`moe_check.check_layer` with every rank running its experts grouped (no capacity: dropless)."""
    return moe_check.check_layer(rank, world_size, layer_cls=GroupedExpertParallelMoE, **kwargs)


def _flops(layer, x):
    with FlopCounterMode(display=False) as fc:
        out = layer(x)
    return out, fc.get_total_flops()


def compare(tokens=256, hidden=16, experts=8, top_k=2, ffn=32, skew=1.5, capacity_factors=(1.0, 1.25, 2.0),
            seed=0):
    """One batch whose tokens share an offset toward expert 0's router row (a skewed load), through:
    the loop reference without capacity (`moe.MoE`), `DroplessMoE`, and for each capacity factor the
    loop reference with capacity and `PaddedCapacityMoE`. Per variant: FLOPs counted, slots computed,
    pairs dropped, the error against its reference. What ran for the grouped GEMM, and the FLOPs
    FlopCounterMode sees in it."""
    with moe_routing.one_thread():     # tiny products: one thread is several times faster on a busy box
        return _compare(tokens, hidden, experts, top_k, ffn, skew, capacity_factors, seed)


def skewed_batch(layer, tokens, hidden, skew, seed):
    """(T, h) tokens that share an offset toward ``layer``'s router row 0: a skewed load."""
    g = torch.Generator().manual_seed(seed + 1)
    toward = layer.router.weight.detach()[0] / layer.router.weight.detach()[0].norm()
    return torch.randn(tokens, hidden, generator=g) + skew * toward


def dropped_over_seeds(seeds, tokens=256, hidden=16, experts=8, top_k=2, ffn=32, skew=1.5,
                       capacity_factors=(1.0, 1.25, 2.0)):
    """Per seed, `compare`'s batch routed only (no expert runs, no FLOPs: the slots, and so the
    FLOPs, are N * C whatever the seed): pairs dropped at each capacity factor, and the smallest
    routing margin over the seeds."""
    out, margin = {}, float("inf")
    with torch.no_grad():
        for seed in seeds:
            for cf in capacity_factors:
                layer = moe.MoE(hidden, experts, top_k, cf, ffn, seed)
                r = layer.decide(skewed_batch(layer, tokens, hidden, skew, seed))
                out[(seed, cf)] = int((~r.keep).sum())
                margin = min(margin, r.margin)
    return out, margin


def _compare(tokens, hidden, experts, top_k, ffn, skew, capacity_factors, seed):
    ref = moe.MoE(hidden, experts, top_k, None, ffn, seed)
    x = skewed_batch(ref, tokens, hidden, skew, seed)                                     # (T, h)
    want, ref_flops = _flops(ref, x)
    loads = torch.bincount(ref.routing.idx.reshape(-1), minlength=experts)
    dl = DroplessMoE(hidden, experts, top_k, None, ffn, seed)
    got, dl_flops = _flops(dl, x)      # FlopCounterMode does not see torch._grouped_mm (0 FLOPs counted)
    # the dropless FLOPs: the loop reference computes the same rows, expert by expert, and is counted
    rows = [{"variant": "dropless (grouped GEMM)", "slots": int(loads.sum()), "dropped": 0,
             "flops": ref_flops, "error": (got - want).abs().max().item()}]
    for cf in capacity_factors:
        capped = moe.MoE(hidden, experts, top_k, cf, ffn, seed)
        want_c, _ = _flops(capped, x)
        padded = PaddedCapacityMoE(hidden, experts, top_k, cf, ffn, seed)
        got_c, flops_c = _flops(padded, x)
        rows.append({"variant": f"capacity factor {cf:g}", "slots": experts * padded.capacity(tokens),
                     "dropped": int((~capped.routing.keep).sum()), "flops": flops_c,
                     "error": (got_c - want_c).abs().max().item()})
    return {"rows": rows, "loads": loads.tolist(), "pairs": tokens * top_k, "ran": grouped_mm.last,
            "dropless_flops_counter_sees": dl_flops, "loop_flops": ref_flops,
            "routing_margin": ref.routing.margin}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Dropless MoE as a grouped GEMM beside capacity buffers (one process), and with "
                   "--world-size above 1 the expert-parallel layer running its experts grouped.",
                   world_size_default=1)
    args = cli.parse(p, argv)
    if args.world_size == 1:
        r = compare()
        result = {k: r[k] for k in ("rows", "ran", "loads")}
        text = "\n".join(f"{row['variant']:26s} slots {row['slots']:5d}  dropped {row['dropped']:4d}  FLOPs "
                         f"{row['flops']:,}" for row in r["rows"])
    else:
        moe.check_ep(8, args.world_size)
        res = launch.launch(check_grouped, args.world_size, timeout=args.timeout)
        if res is None:
            return
        result = {"max_abs_error": max(x["max_abs_error"] for x in res), "world_size": len(res),
                  "max_abs_error_grad": max(x["max_abs_error_grad"] for x in res)}
        text = f"grouped expert-parallel layer vs one process: max error {result['max_abs_error']:.1e}"
    cli.report(result, args, text)


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
