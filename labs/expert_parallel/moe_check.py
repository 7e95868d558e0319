"""Chapter 7: the expert-parallel layer against one process: outputs, gradients, and what the
all-to-alls carried, row by row.

`check_layer` runs `moe.ExpertParallelMoE` on ep ranks beside `moe.MoE` in one process with the same
weights and tokens, and checks three things a plausible bug breaks:
- outputs and every gradient (router, experts, input) equal the single-process layer's;
- the rows that arrive on each rank are the right tokens' hidden states, in the order the split
  sizes describe, compared with the rows the reference's routing of every rank's tokens sends there
  (a dispatch whose row order does not match its split sizes sends the right number of bytes to
  every rank and fails this check: see ``layer_cls`` and the tests);
- the bytes sent to each destination, read from the tensor slices handed to the all-to-all, equal
  the rows the reference's routing sends there times h times the element size.

    python -m labs.expert_parallel.moe_check --world-size 2 --experts 8 --top-k 2 \\
        --capacity-factor 1.25 --json
"""
import torch

from labs.expert_parallel import moe
from labs.launcher import launch, preflight
from labs.measure import comm


def _grad_errors(ep_layer, full, rank, per):
    errs = {"router": (ep_layer.router.weight.grad - full.router.weight.grad).abs().max().item()}
    for j, ex in enumerate(ep_layer.experts):
        for (name, p), q in zip(ex.named_parameters(), full.experts[rank * per + j].parameters()):
            errs[f"expert{rank * per + j}.{name}"] = (p.grad - q.grad).abs().max().item()
    return errs


def _sent(log, what, rank):
    """Bytes per destination that this rank's ``what`` all-to-all sent (its own slice set to 0)."""
    to = next(entry["to"] for entry in log if entry["what"] == what)
    return [0 if d == rank else b for d, b in enumerate(to)]


def reference_dispatch(routings, per, x_all, tokens):
    """What the dispatch must send, from the single-process routing of every rank's tokens: for each
    source rank, its kept (token, expert) pairs sorted by expert (stable), as (destination rank of
    each pair, the hidden-state row of each pair)."""
    out = []
    for c, r in enumerate(routings):
        t, slot = r.keep.nonzero(as_tuple=True)
        e = r.idx[t, slot]
        o = torch.argsort(e, stable=True)
        out.append((e[o] // per, x_all[c * tokens + t[o]]))
    return out


def check_layer(rank, world_size, tokens=32, hidden=16, experts=8, top_k=2, capacity_factor=None, seed=0,
                node_limit=None, layer_cls=None):
    """The expert-parallel layer beside the single-process one with the same weights, on the same
    tokens (rank r's T tokens are rows rT ... rT + T - 1 of the reference batch; capacity is per
    rank's batch, so the reference routes each rank's rows as one batch).

    Returns max_abs_error (output), grad_errors (router, each local expert's parameters, input),
    dropped_fraction and loads (routed pairs per expert, all ranks), rows_arrived_right (the rows
    received equal the reference's, exactly: they are copies), and bytes per destination: sent_to
    (dispatch, read from the payloads) beside derived_to (from the reference's routing), the same
    for combine, and the split-size exchange.
    """
    per = moe.check_ep(experts, world_size)
    dev = launch.device()
    full = moe.MoE(hidden, experts, top_k, capacity_factor, seed=seed).to(dev)
    full.node_limit = node_limit  # (experts per node, M): DeepSeek-V3's node-limited routing
    g = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(world_size * tokens, hidden, generator=g).to(dev)
    up = torch.randn(world_size * tokens, hidden, generator=g).to(dev)  # a fixed dL/dy
    x_ref = x_all.clone().requires_grad_()
    chunks, routings = [], []
    for c in range(world_size):
        chunks.append(full(x_ref[c * tokens:(c + 1) * tokens]))
        routings.append(full.routing)
    ref = torch.cat(chunks)
    (ref * up).sum().backward()
    # the same weights, fresh grads
    twin = moe.MoE(hidden, experts, top_k, capacity_factor, seed=seed).to(dev)
    twin.node_limit = node_limit
    layer = (layer_cls or moe.ExpertParallelMoE)(twin)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    x = x_all[mine].clone().requires_grad_()
    with moe.payloads() as forward, comm.counting() as tally:
        out = layer(x)
    with moe.payloads() as backward:
        (out * up[mine]).sum().backward()
    comm.all_reduce(layer.router.weight.grad)  # data parallelism's sum of the router's gradient
    errs = _grad_errors(layer, full, rank, per)
    errs["input"] = (x.grad - x_ref.grad[mine]).abs().max().item()
    row = hidden * x.element_size()
    want = reference_dispatch(routings, per, x_all, tokens)
    expected = torch.cat([rows[dest == rank] for dest, rows in want])          # what must arrive here
    # copies: exact
    arrived = layer.received.shape == expected.shape and torch.equal(layer.received, expected)
    kept = sum(int(r.keep.sum()) for r in routings)
    loads = torch.bincount(torch.cat([r.idx.reshape(-1) for r in routings]), minlength=experts)
    derived_to = [0 if d == rank else int((want[rank][0] == d).sum()) * row for d in range(world_size)]
    derived_back = [0 if c == rank else int((want[c][0] == rank).sum()) * row for c in range(world_size)]
    return {"max_abs_error": (out - ref[mine]).abs().max().item(), "grad_errors": errs,
            "max_abs_error_grad": max(errs.values()), "rows_arrived_right": arrived,
            "dropped_fraction": 1 - kept / (world_size * tokens * top_k),
            "dropped_pairs": world_size * tokens * top_k - kept, "loads": loads.tolist(),
            "max_over_mean_load": (loads.max() / loads.float().mean()).item(),
            "sent_to": _sent(forward, "dispatch", rank), "derived_to": derived_to,
            "combine_to": _sent(forward, "combine", rank), "derived_combine_to": derived_back,
            "backward_to": {w: _sent(backward, w, rank) for w in ("dispatch backward", "combine backward")},
            "dispatch_bytes": sum(_sent(forward, "dispatch", rank)),
            "combine_bytes": sum(_sent(forward, "combine", rank)),
            "splits_bytes": sum(_sent(forward, "splits", rank)),
            "all_to_all_calls": tally.calls("all_to_all"), "row_bytes": row,
            "routing_margin": min(r.margin for r in routings)}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Expert parallelism: an MoE layer over ranks against the single-process one, "
                   "all-to-all bytes counted.")
    p.add_argument("--experts", type=cli.positive_int, default=8)
    p.add_argument("--top-k", type=cli.positive_int, default=2)
    p.add_argument("--capacity-factor", type=cli.positive_float, default=1.25)
    p.add_argument("--tokens", type=cli.positive_int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=cli.positive_int, default=16)
    args = cli.parse(p, argv)
    moe.check_ep(args.experts, args.world_size)
    if args.top_k > args.experts:
        raise ValueError(f"top-k = {args.top_k} is more than the {args.experts} experts; choose "
                         "k <= experts.")
    t, h, n = args.tokens * args.world_size, args.hidden, args.experts
    preflight.check_fits(args.world_size, 16 * 4 * (t * h * (2 + args.top_k) + n * 4 * h * h),
                         "--tokens or --hidden")
    results = launch.launch(check_layer, args.world_size, args.tokens, h, n, args.top_k, args.capacity_factor,
                            timeout=args.timeout)
    if results is None:
        return
    r0 = results[0]
    result = {"max_abs_error": max(r["max_abs_error"] for r in results),
              "max_abs_error_grad": max(r["max_abs_error_grad"] for r in results),
              "rows_arrived_right": all(r["rows_arrived_right"] for r in results),
              "dropped_fraction": r0["dropped_fraction"], "max_over_mean_load": r0["max_over_mean_load"],
              "bytes_sent": [r["dispatch_bytes"] + r["combine_bytes"] for r in results],
              "derived_bytes_sent": [sum(r["derived_to"]) + sum(r["derived_combine_to"]) for r in results],
              "splits_bytes": [r["splits_bytes"] for r in results], "world_size": len(results)}
    cli.report(result, args, f"MoE over {len(results)} ranks: max error {result['max_abs_error']:.1e} "
               f"(grads {result['max_abs_error_grad']:.1e}); rows arrived right: "
               f"{result['rows_arrived_right']}; dropped {result['dropped_fraction']:.3f}; max/mean load "
               f"{result['max_over_mean_load']:.2f}; dispatch+combine bytes sent per rank "
               f"{result['bytes_sent']} (split sizes: {result['splits_bytes']})")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
