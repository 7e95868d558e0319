"""Chapter 7: DeepSeek-V3's node-deduplicating dispatch, built and counted on a simulated 2-node grid.

DeepSeek-V3 technical report (arXiv 2412.19437), section 3.2.2: once its routing is decided, a
token goes over InfiniBand to the GPU with the same in-node index on each of its target nodes, once
per node, and is forwarded there over NVLink to the GPUs that host its experts; combine runs the
other way, accumulating on the forwarding GPU before the IB hop back. Node-limited routing (section
2.1.2) caps a token's target nodes at M, so it crosses the node boundary at most M times whatever k is.

Ranks are labelled node = rank // G and in-node index l = rank % G (G ranks per node: the fastest
axis of the book's grid, `labs.groups`). Two all-to-alls replace the flat one:
1. across nodes (world group): one row per (token, target node), to rank (node, l); the copy for
   the token's own node stays on the rank;
2. inside each node (node group): one row per (token, rank hosting one of its experts); a rank
   hosting several of them gets one copy.
Each row travels with its routing, the k expert ids (int64) and gates (fp32), counted apart as
metadata. Combine returns, per (token, rank), the gate-weighted sum of that rank's experts' outputs,
summed per (token, node) on the forwarding rank before it crosses back. Bytes per link tier are
read from the payloads handed to each all-to-all, per destination (`moe.payloads`): another node's
rank is InfiniBand, the same node's NVLink. `derived_rows` counts the same rows from the
single-process routing, independently.

    python -m labs.expert_parallel.node_dispatch --world-size 4 --json
"""
import torch

from labs import groups
from labs.dims import ParallelDims
from labs.expert_parallel import moe
from labs.launcher import launch


def _send(tensors, dest, n, group, what):
    """Every tensor's rows sorted by destination (stable) and exchanged in one all-to-all each;
    returns the received tensors, the receive splits and the send splits."""
    o = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=n)
    recv = moe.exchange(send, [1] * n, [1] * n, group, f"{what} splits").tolist()
    send = send.tolist()
    out = [moe.exchange(t[o], recv, send, group, w)
           for t, w in zip(tensors, (what, f"{what} ids", f"{what} gates"))]
    return out, recv, send, o


def hierarchical_forward(layer, x, ranks_per_node, node_group):
    """The forward of `moe.ExpertParallelMoE` ``layer`` with DeepSeek-V3's two-hop dispatch and
    combine. Returns the layer's output, (T, h)."""
    rank, world, per, G = layer.rank, layer.ep, layer.per, ranks_per_node
    me, l = divmod(rank, G)
    r = layer.decide(x)
    ids = torch.where(r.keep, r.idx, -1)                           # (T, k) kept experts, -1 = none
    node_of = torch.where(ids >= 0, ids // per // G, -1)          # (T, k) their nodes
    # hop 1, across nodes: one row per (token, target node), to (node, l)
    t1, m1 = [], []
    for m in range(world // G):
        hit = (node_of == m).any(1).nonzero().squeeze(1)
        t1.append(hit), m1.append(torch.full_like(hit, m))
    t1, m1 = torch.cat(t1), torch.cat(m1)
    ids1 = torch.where(node_of[t1] == m1[:, None], ids[t1], -1)   # only that node's experts
    (rows1, idr1, gr1), recv1, send1, o1 = _send([x[t1], ids1, r.gates[t1].detach()], m1 * G + l, world, None,
                                                 "node dispatch")
    # hop 2, inside the node: one row per (row, local rank hosting one of its experts)
    rank_of = torch.where(idr1 >= 0, idr1 // per - me * G, -1)    # (R1, k) in-node index of each expert
    on_rank = rank_of[:, None, :] == torch.arange(G, device=x.device)[None, :, None]   # (T, G, k)
    i2, j2 = on_rank.any(2).nonzero(as_tuple=True)
    ids2 = torch.where(rank_of[i2] == j2[:, None], idr1[i2], -1)
    (rows2, idr2, gr2), recv2, send2, o2 = _send([rows1[i2], ids2, gr1[i2]], j2, G, node_group,
                                                 "intra dispatch")
    # the experts: each row, the gate-weighted sum of this rank's experts it was sent to
    part = torch.zeros_like(rows2)
    for j, ex in enumerate(layer.experts):
        row, slot = (idr2 == rank * per + j).nonzero(as_tuple=True)
        part = part.index_add(0, row, gr2[row, slot, None] * ex(rows2[row]))
    # combine: hop 2 back, summed per (token, node) on the forwarding rank, then hop 1 back
    back2 = moe.exchange(part, send2, recv2, node_group, "intra combine")
    acc = torch.zeros_like(rows1).index_add(0, i2[o2], back2)
    back1 = moe.exchange(acc, send1, recv1, None, "node combine")
    out = torch.zeros_like(x).index_add(0, t1[o1], back1)
    return x + out if layer.residual else out


def derived_rows(routings, per, ranks_per_node):
    """From the single-process routing of every rank's tokens: rows each rank sends across nodes
    and inside its node, flat (one row per kept (token, expert)) and node-deduplicated (one row per
    (token, remote node) across; inside a node, sent by the forwarding rank (node, l) of the token's
    source, one row per other rank of that node hosting one of its experts)."""
    G = ranks_per_node
    out = [{"flat": {"ib": 0, "nvlink": 0}, "node": {"ib": 0, "nvlink": 0}} for _ in routings]
    for rank, r in enumerate(routings):
        me, l = divmod(rank, G)
        for t in range(r.idx.shape[0]):
            dests = [int(e) // per for e, k in zip(r.idx[t], r.keep[t]) if k]
            out[rank]["flat"]["ib"] += sum(d // G != me for d in dests)
            out[rank]["flat"]["nvlink"] += sum(d // G == me and d != rank for d in dests)
            for m in {d // G for d in dests}:
                out[rank]["node"]["ib"] += m != me
                out[m * G + l]["node"]["nvlink"] += len({d for d in dests if d // G == m} - {m * G + l})
    return out


def _tiers(log, rank, G, node_group_ranks):
    """Bytes this rank sent to other ranks per tier, summed over the log's entries per kind."""
    tiers = {}
    for entry in log:
        where = node_group_ranks if entry["what"].startswith("intra") else range(len(entry["to"]))
        for d, b in zip(where, entry["to"]):
            if d != rank:
                key = ("ib" if d // G != rank // G else "nvlink", entry["what"])
                tiers[key] = tiers.get(key, 0) + b
    return tiers


def compare(rank, world_size, ranks_per_node=2, tokens=64, hidden=16, experts=16, top_k=4, seed=0):
    """Flat and node-deduplicated dispatch on the same layer and tokens, with and without a limit
    of one node per token (M = 1). Per setting: bytes per tier and kind (counted), the rows derived
    from the single-process routing, the error of each forward against the single-process layer."""
    grid = groups.Groups(ParallelDims.build(world_size, tp=ranks_per_node))   # tp axis = the ranks of a node
    dev, per = launch.device(), moe.check_ep(experts, world_size)
    epn = per * ranks_per_node                                            # experts per node
    g = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(world_size * tokens, hidden, generator=g).to(dev)
    x = x_all[rank * tokens:(rank + 1) * tokens]
    out = {}
    for name, limit in (("unlimited", None), ("one_node", (epn, 1))):
        full = moe.MoE(hidden, experts, top_k, None, seed=seed).to(dev)
        full.node_limit = limit
        with torch.no_grad():
            ref, routings = [], []
            for c in range(world_size):
                ref.append(full(x_all[c * tokens:(c + 1) * tokens]))
                routings.append(full.routing)
            layer = moe.ExpertParallelMoE(full)
            with moe.payloads() as flat_log:
                flat = layer(x)
            with moe.payloads() as node_log:
                node = hierarchical_forward(layer, x, ranks_per_node, grid.tp)
        nodes_per_token = (layer.routing.idx // epn).sort(1).values.diff(dim=1).ne(0).sum(1) + 1
        out[name] = {"flat": _tiers(flat_log, rank, ranks_per_node, grid.tp_ranks),
                     "node": _tiers(node_log, rank, ranks_per_node, grid.tp_ranks),
                     "derived_rows": derived_rows(routings, per, ranks_per_node)[rank],
                     "error_flat": (flat - ref[rank]).abs().max().item(),
                     "error_node": (node - ref[rank]).abs().max().item(),
                     "max_nodes_per_token": int(nodes_per_token.max()),
                     "row_bytes": hidden * x.element_size(),
                     "routing_margin": min(r.margin for r in routings)}
    return out


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("DeepSeek-V3's node-deduplicating dispatch beside the flat all-to-all, bytes per link "
                   "tier counted.", world_size_default=4)
    p.add_argument("--ranks-per-node", type=cli.positive_int, default=2)
    args = cli.parse(p, argv)
    if args.world_size % args.ranks_per_node or args.world_size == args.ranks_per_node:
        raise ValueError(f"world size {args.world_size} must be a multiple of --ranks-per-node "
                         f"{args.ranks_per_node}, with at least two nodes; choose e.g. --world-size 4 "
                         "--ranks-per-node 2.")
    moe.check_ep(16, args.world_size)
    results = launch.launch(compare, args.world_size, args.ranks_per_node, timeout=args.timeout)
    if results is None:
        return
    total = {k: {d: sum(b for r in results for (tier, what), b in r[k][d].items()
                        if tier == "ib" and what in ("dispatch", "node dispatch")) for d in ("flat", "node")}
             for k in ("unlimited", "one_node")}
    worst = max(r[k][e] for r in results for k in ("unlimited", "one_node")
                for e in ("error_flat", "error_node"))
    result = {"dispatch_bytes_across_nodes": total, "max_abs_error": worst, "world_size": len(results)}
    cli.report(result, args, f"dispatch bytes across nodes (flat / node-deduplicated): {total}; "
               f"max error against one process {worst:.1e}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
