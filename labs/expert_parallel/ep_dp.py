"""Chapter 7: which group reduces which gradient under expert + data parallelism, counted.

ep x edp ranks on the book's grid (`labs.dims`, ep carved out of dp on its faster side: an ep group
is a run of consecutive ranks, an edp group the ranks ep apart). Each rank holds the router,
replicated on every rank, and the N/ep experts of its place in its ep group; the edp ranks with
the same place hold the same experts, the expert-data-parallel replicas (Megatron Core's EDP group,
next to its EP and ETP groups: MoE parallel folding, Liu et al. 2025, arXiv 2504.14960). Each rank
routes its own tokens; dispatch and combine run inside its ep group. After backward:
- the router's gradient (and any dense weight's) is this rank's tokens' share: all-reduce over
  all ep * edp ranks;
- an expert's gradient already sums every token of its ep group that chose it: all-reduce over
  the edp group only, the ranks holding the same experts. Over every rank it would add other
  experts' gradients to it; not at all, it would miss the other replicas' tokens.
Every all-reduce runs as chapter 2's hand ring (`hand_ring.hand_collectives`), each message counted
as sent: 2 (n - 1)/n * M bytes per rank on n ranks, M = N h e for the router on n = ep * edp,
M = (N/ep) P_e e for a rank's experts (P_e parameters each) on n = edp.

    python -m labs.expert_parallel.ep_dp --world-size 4 --ep 2 --json
"""
import torch

from labs import groups
from labs.dims import ParallelDims
from labs.data_parallel import hand_ring
from labs.expert_parallel import moe
from labs.launcher import launch
from labs.formulas import costs
from labs.measure import comm


def _flat(params):
    return torch.cat([p.grad.reshape(-1) for p in params])


def check(rank, world_size, ep=2, tokens=16, hidden=16, experts=8, top_k=2, seed=0):
    """The layer on ep x edp ranks beside one process on all their tokens. Returns the gradient
    errors with the right groups, and with the expert gradients reduced over every rank or not at
    all (the two plausible bugs); bytes sent per rank, counted, for each reduction; the payloads."""
    # ep: consecutive ranks; edp: the same experts
    grid = groups.Groups(ParallelDims.build(world_size, ep=ep))
    dev, per = launch.device(), moe.check_ep(experts, ep)
    full = moe.MoE(hidden, experts, top_k, None, seed=seed).to(dev)
    g = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(world_size * tokens, hidden, generator=g).to(dev)
    up = torch.randn(world_size * tokens, hidden, generator=g).to(dev)    # a fixed dL/dy
    (full(x_all) * up).sum().backward()               # no capacity: one batch routes as the ranks' do
    layer = moe.ExpertParallelMoE(moe.MoE(hidden, experts, top_k, None, seed=seed).to(dev), group=grid.ep)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    (layer(x_all[mine]) * up[mine]).sum().backward()
    expert_params = list(layer.experts.parameters())
    local = _flat(expert_params)                                     # this rank's share, before any reduction
    everyone = local.clone()
    with hand_ring.hand_collectives():
        with comm.counting() as router_tally:
            comm.all_reduce(layer.router.weight.grad)                # every rank: ep * edp
        with comm.counting() as expert_tally:
            reduced = local.clone()
            comm.all_reduce(reduced, group=grid.edp)                  # the edp group only
        comm.all_reduce(everyone)                                    # the bug: over every rank
    first = grid.coords["ep"] * per                                  # this rank's first expert
    want = _flat([p for e in range(first, first + per) for p in full.experts[e].parameters()])
    return {"router_error": (layer.router.weight.grad - full.router.weight.grad).abs().max().item(),
            "expert_error": (reduced - want).abs().max().item(),
            "expert_error_over_every_rank": (everyone - want).abs().max().item(),
            "expert_error_not_reduced": (local - want).abs().max().item(),
            "router_bytes_sent": router_tally.bytes_sent, "expert_bytes_sent": expert_tally.bytes_sent,
            "router_payload": router_tally.payload_bytes, "expert_payload": expert_tally.payload_bytes,
            "edp_group": grid.edp_ranks, "ep_group": grid.ep_ranks,
            "experts": list(range(first, first + per)), "routing_margin": full.routing.margin}


def ring_bytes(payload, n):
    """Formula: what one rank sends in a ring all-reduce of ``payload`` bytes over n ranks."""
    return float(costs.sent("all_reduce", payload, n))


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Expert + data parallelism: which group reduces the router's and the experts' "
                   "gradients, bytes counted.", world_size_default=4)
    p.add_argument("--ep", type=cli.positive_int, default=2)
    args = cli.parse(p, argv)
    ParallelDims.build(args.world_size, ep=args.ep)
    moe.check_ep(8, args.ep)
    results = launch.launch(check, args.world_size, args.ep, timeout=args.timeout)
    if results is None:
        return
    r0 = results[0]
    result = {k: max(r[k] for r in results) for k in ("router_error", "expert_error",
                                                      "expert_error_over_every_rank")}
    result.update(router_bytes_sent=r0["router_bytes_sent"], expert_bytes_sent=r0["expert_bytes_sent"],
                  world_size=len(results), ep=args.ep)
    cli.report(result, args,
               f"router all-reduce over {len(results)} ranks: {r0['router_bytes_sent']} bytes sent per "
               f"rank; experts over edp = {len(r0['edp_group'])}: {r0['expert_bytes_sent']} bytes; errors "
               f"{result['router_error']:.1e} / {result['expert_error']:.1e} (over every rank: "
               f"{result['expert_error_over_every_rank']:.1e})")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
