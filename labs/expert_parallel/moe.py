"""Chapter 7: a mixture-of-experts layer and expert parallelism, with the all-to-all bytes counted.

The layer: a router W_r gives each of T tokens the probabilities p_i(x) = softmax(x W_r)_i over N
experts E_i; each token goes to its top-k experts and the layer computes sum_{i in top-k} p_i(x) E_i(x)
(Fedus et al. 2021, "Switch Transformers", eq. 2; top-2 routing with an expert capacity, GShard,
Lepikhin et al. 2020, section 2.2). An expert takes at most C = ceil(T k / N * capacity_factor)
(token, expert) pairs; a pair beyond C overflows and that expert skips the token.

The residual is not in those equations: it is the transformer block's, x + FFN(x), which carries a
token that overflowed all its experts to the next layer unchanged (Switch section 2.2, GShard
section 2.2). `MoE` adds x itself (``residual=True``, the form of DeepSeek-V3's eq. 12, h'_t = u_t
+ ...), so that the layer alone shows what a dropped token leaves with; inside a block that adds
x already (`labs.model.Block`), ``residual=False``.

Expert parallelism: the N experts are spread over ep ranks (N/ep each); every rank routes its own
tokens, and two all-to-alls move them: dispatch (each kept (token, expert) pair's row of h values
to the expert's rank) and combine (the expert's output row back). The split sizes are exchanged
first (one all-to-all of N counts), since no rank knows beforehand how many rows it will receive.
Every payload is read from the tensor handed to `comm.all_to_all`, per destination (`payloads`).
The lab that checks it against one process is `labs.expert_parallel.moe_check`.
"""
import contextlib
import copy
import torch
import torch.distributed as dist
import torch.nn as nn

from labs.expert_parallel.router import capacity, route
from labs.measure import comm

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
    """The single-process layer: router, N experts, top-k, capacity; sum_kept p_i E_i(x), plus x
    when ``residual``.

    ``capacity_factor=None`` drops nothing. ``self.routing`` keeps the last step's routing, for
    the loads and the balancing losses.
    """

    def __init__(self, hidden=16, experts=8, top_k=2, capacity_factor=None, ffn=32, seed=0, residual=True):
        super().__init__()
        torch.manual_seed(seed)
        self.top_k, self.capacity_factor, self.num_experts = top_k, capacity_factor, experts
        self.residual = residual
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
        return x + out if self.residual else out


def check_ep(experts, ep):
    if experts % ep:
        raise ValueError(f"{experts} experts cannot be spread evenly over ep = {ep} ranks; "
                         "choose a number of experts divisible by the world size.")
    return experts // ep


def exchange(x, out_splits, in_splits, group, what):
    """All-to-all of rows with uneven splits; logs the bytes sent to each destination, read from
    the slices of ``x`` the collective sends."""
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
        return exchange(x, out_splits, in_splits, group, what)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, what = ctx.args
        return exchange(grad, in_splits, out_splits, group, what + " backward"), None, None, None, None


class ExpertParallelMoE(nn.Module):
    """The same layer with this rank's N/ep experts: experts r*N/ep ... (r+1)*N/ep - 1 on rank r.

    The router (and bias) is replicated: its gradient is this rank's tokens' share, summed over
    ranks by the caller as data parallelism would (`labs.expert_parallel.ep_dp` says which group).
    """

    def __init__(self, full, group=None):
        super().__init__()
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.per = check_ep(full.num_experts, self.ep)
        self.router = copy.deepcopy(full.router)
        self.register_buffer("bias", full.bias.clone())
        first = self.rank * self.per
        self.experts = nn.ModuleList(copy.deepcopy(full.experts[e]) for e in range(first, first + self.per))
        self.top_k, self.capacity_factor, self.num_experts = (full.top_k, full.capacity_factor,
                                                              full.num_experts)
        self.node_limit, self.residual = full.node_limit, full.residual

    capacity, decide = MoE.capacity, MoE.decide

    def order(self, e):
        """The order the kept pairs are sent in: by expert, hence by destination rank, as the split
        sizes (counts per expert, in expert order) describe them."""
        return torch.argsort(e, stable=True)

    def run_experts(self, rows, local):
        """Each local expert on the rows that arrived for it: variable-sized batches, no padding."""
        y = torch.zeros_like(rows)
        for j, ex in enumerate(self.experts):
            m = (local == j).nonzero().squeeze(1)
            y = y.index_add(0, m, ex(rows[m]))
        return y

    def forward(self, x):                                      # (T, h)
        r = self.decide(x)
        t, slot = r.keep.nonzero(as_tuple=True)
        e = r.idx[t, slot]
        o = self.order(e)
        t, slot, e = t[o], slot[o], e[o]
        counts = torch.bincount(e, minlength=self.num_experts)   # (N,) rows this rank sends per expert
        recv = exchange(counts, [self.per] * self.ep, [self.per] * self.ep, self.group, "splits")
        send_splits = counts.view(self.ep, self.per).sum(1).tolist()
        recv_splits = recv.view(self.ep, self.per).sum(1).tolist()
        rows = _AllToAll.apply(x[t], recv_splits, send_splits, self.group, "dispatch")  # (R, h)
        # rows arrive by source rank, inside each by local expert
        local = torch.repeat_interleave(torch.arange(self.per, device=x.device).repeat(self.ep), recv)
        self.received, self.received_splits = rows.detach(), recv_splits
        y = self.run_experts(rows, local)
        back = _AllToAll.apply(y, send_splits, recv_splits, self.group, "combine")      # (S, h)
        self.sent_rank, self.sent_token = e // self.per, t     # where each row sent went, and its token
        out = torch.zeros_like(x).index_add(0, t, r.gates[t, slot, None] * back)
        return x + out if self.residual else out
