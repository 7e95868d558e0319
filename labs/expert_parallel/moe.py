"""Chapter 7: a mixture-of-experts layer and expert parallelism, with the all-to-all bytes counted.

The layer (Fedus et al. 2021, "Switch Transformers", section 2.1-2.2): a router W_r gives each of
T tokens the probabilities p_i(x) = softmax(x W_r)_i over N experts E_i; each token goes to its
top-k experts and the layer returns y = x + sum_{i in top-k} p_i(x) E_i(x). An expert takes at
most C = ceil(T k / N * capacity_factor) tokens (Switch section 2.2 with k = 1); a token beyond C
overflows, skips that expert and leaves with the residual x alone.

Expert parallelism: the N experts are spread over ep ranks (N/ep each); every rank routes its own
tokens, and two all-to-alls move them: dispatch (each kept (token, expert) pair's row of h values
to the expert's rank) and combine (the expert's output row back). The split sizes are exchanged
first (one all-to-all of N counts), since no rank knows beforehand how many rows it will receive.
Every payload is read from the tensor handed to `comm.all_to_all`, per destination (`payloads`).

    python -m labs.expert_parallel.moe --world-size 2 --experts 8 --top-k 2 --capacity-factor 1.25 --json
"""
import contextlib
import copy
import torch
import torch.distributed as dist
import torch.nn as nn

from labs.expert_parallel.router import capacity, route
from labs.measure import comm
from labs.launcher import launch, preflight

_logs = []  # the payload logs currently recording, innermost last


@contextlib.contextmanager
def payloads():
    """Record every all-to-all this module makes inside the block: what it carried ("splits",
    "dispatch", "combine", with " backward") and the bytes it sent to each destination rank, read
    from the slices of the tensor handed to the collective."""
    log = []
    _logs.append(log)
    try:
        yield log
    finally:
        _logs.remove(log)


def expert(hidden, ffn):
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


class MoE(nn.Module):
    """The single-process layer: router, N experts, top-k, capacity; y = x + sum_kept p_i E_i(x).

    ``capacity_factor=None`` drops nothing. ``self.routing`` keeps the last step's routing, for
    the loads and the Switch auxiliary loss.
    """

    def __init__(self, hidden=16, experts=8, top_k=2, capacity_factor=None, ffn=32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.top_k, self.capacity_factor, self.num_experts = top_k, capacity_factor, experts
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(expert(hidden, ffn) for _ in range(experts))
        self.register_buffer("bias", torch.zeros(experts))  # DeepSeek-V3 b_i; stays 0 unless trained
        self.node_limit = None                              # (experts_per_node, M) for node-limited routing

    def capacity(self, tokens):
        if self.capacity_factor is None:
            return None
        return capacity(tokens, self.num_experts, self.top_k, self.capacity_factor)

    def decide(self, x):
        epn, m = self.node_limit or (None, None)
        self.routing = route(self.router(x), self.top_k, self.capacity(x.shape[0]), self.bias, epn, m)
        return self.routing

    def forward(self, x):                                      # (T, h)
        r = self.decide(x)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            t, slot = ((r.idx == e) & r.keep).nonzero(as_tuple=True)
            out = out.index_add(0, t, r.gates[t, slot, None] * ex(x[t]))
        return x + out


def check_ep(experts, ep):
    if experts % ep:
        raise ValueError(f"{experts} experts cannot be spread evenly over ep = {ep} ranks; "
                         "choose a number of experts divisible by the world size.")
    return experts // ep


def _exchange(x, out_splits, in_splits, group, what):
    """All-to-all of rows with uneven splits; logs the bytes sent to each destination."""
    row = x[:1].numel() * x.element_size()
    sizes = [x.narrow(0, start, n).numel() * x.element_size()
             for start, n in zip([0, *torch.tensor(in_splits).cumsum(0).tolist()[:-1]], in_splits)]
    for log in _logs:
        log.append({"what": what, "to": sizes, "row_bytes": row})
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), group=group, output_split_sizes=out_splits,
                    input_split_sizes=in_splits)
    return out


class _AllToAll(torch.autograd.Function):
    """Dispatch or combine; its backward is the same all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, what):
        ctx.args = (out_splits, in_splits, group, what)
        return _exchange(x, out_splits, in_splits, group, what)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, what = ctx.args
        return _exchange(grad, in_splits, out_splits, group, what + " backward"), None, None, None, None


class ExpertParallelMoE(nn.Module):
    """The same layer with this rank's N/ep experts: experts r*N/ep ... (r+1)*N/ep - 1 on rank r.

    The router (and bias) is replicated: its gradient is this rank's tokens' share, summed over
    ranks by the caller as data parallelism would.
    """

    def __init__(self, full, group=None):
        super().__init__()
        self.group, self.full_config = group, full
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.per = check_ep(full.num_experts, self.ep)
        self.router = copy.deepcopy(full.router)
        self.register_buffer("bias", full.bias.clone())
        first = self.rank * self.per
        self.experts = nn.ModuleList(copy.deepcopy(full.experts[e]) for e in range(first, first + self.per))
        self.top_k, self.capacity_factor, self.num_experts = full.top_k, full.capacity_factor, full.num_experts
        self.node_limit = full.node_limit

    capacity, decide = MoE.capacity, MoE.decide

    def forward(self, x):                                      # (T, h)
        r = self.decide(x)
        t, slot = r.keep.nonzero(as_tuple=True)
        e = r.idx[t, slot]
        order = torch.argsort(e, stable=True)                  # by expert, hence by destination rank
        t, slot, e = t[order], slot[order], e[order]
        counts = torch.bincount(e, minlength=self.num_experts)   # (N,) rows this rank sends per expert
        recv = _exchange(counts, [self.per] * self.ep, [self.per] * self.ep, self.group, "splits")
        send_splits = counts.view(self.ep, self.per).sum(1).tolist()
        recv_splits = recv.view(self.ep, self.per).sum(1).tolist()
        rows = _AllToAll.apply(x[t], recv_splits, send_splits, self.group, "dispatch")  # (R, h)
        # rows arrive by source rank, inside each by local expert
        local = torch.repeat_interleave(torch.arange(self.per, device=x.device).repeat(self.ep), recv)
        y = torch.zeros_like(rows)
        for j, ex in enumerate(self.experts):
            m = (local == j).nonzero().squeeze(1)
            y = y.index_add(0, m, ex(rows[m]))
        back = _AllToAll.apply(y, send_splits, recv_splits, self.group, "combine")      # (S, h)
        self.sent_rank, self.sent_token = e // self.per, t     # where each row sent went, and its token
        return x + torch.zeros_like(x).index_add(0, t, r.gates[t, slot, None] * back)


def _grad_errors(ep_layer, full, rank, per):
    errs = {"router": (ep_layer.router.weight.grad - full.router.weight.grad).abs().max().item()}
    for j, ex in enumerate(ep_layer.experts):
        for (name, p), q in zip(ex.named_parameters(), full.experts[rank * per + j].parameters()):
            errs[f"expert{rank * per + j}.{name}"] = (p.grad - q.grad).abs().max().item()
    return errs


def _sent(log, what, rank):
    """Bytes this rank's ``what`` all-to-alls sent to other ranks, from the logged payloads."""
    return sum(b for entry in log if entry["what"] == what for d, b in enumerate(entry["to"]) if d != rank)


def check_layer(rank, world_size, tokens=32, hidden=16, experts=8, top_k=2, capacity_factor=None, seed=0,
                node_limit=None):
    """The expert-parallel layer beside the single-process one with the same weights, on the same
    tokens (rank r's T tokens are rows rT ... rT + T - 1 of the reference batch; capacity is per
    rank's batch, so the reference routes each rank's rows as one batch).

    Returns max_abs_error (output), grad_errors (router, each local expert's parameters, input),
    dropped_fraction and loads (routed pairs per expert, all ranks), and bytes: counted payloads of
    dispatch and combine (forward; backward the same sizes) beside the bytes derived from the
    routing decisions (rows leaving this rank x h x element size), and the split-size exchange.
    """
    per = check_ep(experts, world_size)
    dev = launch.device()
    full = MoE(hidden, experts, top_k, capacity_factor, seed=seed).to(dev)
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
    twin = MoE(hidden, experts, top_k, capacity_factor, seed=seed).to(dev)  # the same weights, fresh grads
    twin.node_limit = node_limit
    layer = ExpertParallelMoE(twin)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    x = x_all[mine].clone().requires_grad_()
    with payloads() as forward, comm.counting() as tally:
        out = layer(x)
    with payloads() as backward:
        (out * up[mine]).sum().backward()
    comm.all_reduce(layer.router.weight.grad)  # data parallelism's sum of the router's gradient
    errs = _grad_errors(layer, full, rank, per)
    errs["input"] = (x.grad - x_ref.grad[mine]).abs().max().item()
    row = hidden * x.element_size()
    owner = [r.idx[r.keep] // per for r in routings]  # destination rank of every kept pair, per source
    kept = sum(int(r.keep.sum()) for r in routings)
    loads = torch.bincount(torch.cat([r.idx.reshape(-1) for r in routings]), minlength=experts)
    return {"max_abs_error": (out - ref[mine]).abs().max().item(), "grad_errors": errs,
            "max_abs_error_grad": max(errs.values()),
            "dropped_fraction": 1 - kept / (world_size * tokens * top_k),
            "loads": loads.tolist(), "max_over_mean_load": (loads.max() / loads.float().mean()).item(),
            "dispatch_bytes": _sent(forward, "dispatch", rank), "combine_bytes": _sent(forward, "combine", rank),
            "backward_bytes": {w: _sent(backward, w, rank) for w in ("dispatch backward", "combine backward")},
            "derived_dispatch_bytes": int((owner[rank] != rank).sum()) * row,
            "derived_combine_bytes": sum(int((o == rank).sum()) for c, o in enumerate(owner) if c != rank) * row,
            "splits_bytes": _sent(forward, "splits", rank), "all_to_all_calls": tally.calls("all_to_all"),
            "formula_bytes_sent": tally.formula_bytes_sent, "row_bytes": row,
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
    check_ep(args.experts, args.world_size)
    if args.top_k > args.experts:
        raise ValueError(f"top-k = {args.top_k} is more than the {args.experts} experts; choose k <= experts.")
    t, h, n = args.tokens * args.world_size, args.hidden, args.experts
    preflight.check_fits(args.world_size, 16 * 4 * (t * h * (2 + args.top_k) + n * 4 * h * h), "--tokens or --hidden")
    results = launch.launch(check_layer, args.world_size, args.tokens, h, n, args.top_k, args.capacity_factor,
                            timeout=args.timeout)
    if results is None:
        return
    r0 = results[0]
    result = {"max_abs_error": max(r["max_abs_error"] for r in results),
              "max_abs_error_grad": max(r["max_abs_error_grad"] for r in results),
              "dropped_fraction": r0["dropped_fraction"], "max_over_mean_load": r0["max_over_mean_load"],
              "bytes_sent": [r["dispatch_bytes"] + r["combine_bytes"] for r in results],
              "derived_bytes_sent": [r["derived_dispatch_bytes"] + r["derived_combine_bytes"] for r in results],
              "splits_bytes": [r["splits_bytes"] for r in results], "world_size": len(results)}
    cli.report(result, args, f"MoE over {len(results)} ranks: max error {result['max_abs_error']:.1e} "
               f"(grads {result['max_abs_error_grad']:.1e}); dropped {result['dropped_fraction']:.3f}; "
               f"max/mean load {result['max_over_mean_load']:.2f}; dispatch+combine bytes sent per rank "
               f"{result['bytes_sent']} (split sizes: {result['splits_bytes']})")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
