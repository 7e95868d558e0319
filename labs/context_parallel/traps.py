"""Chapter 6: two traps of the loss over a sharded sequence, reproduced with ring attention.

Both are reported from practice with Megatron-LM: a masked token mean normalised per rank instead
of by the global token count (issue #673), and a rank whose tokens are all masked, whose 0/0 the
ring's backward carries to every rank (issue #1764). `empty_row` shows the guard inside attention
for a query row whose keys are all masked.
"""
import torch

from labs.measure import comm
from labs.launcher import launch
from labs.context_parallel import methods, ring_attention as ra


def loss_trap(rank, world_size, valid_tokens, seq_len=24, heads=4, head_dim=8, batch=2):
    """A masked token-mean loss over ring attention's output, normalised two ways, against one process.

    Only the first ``valid_tokens`` tokens count (right padding, loss mask m). Per token
    l_t = sum(O_t * U_t) for a fixed U. One process: L = sum_t m_t l_t / sum_t m_t.
    "per_rank_mean": each rank divides by its own count and the ranks' losses are averaged (what
    averaging gradients over cp ranks does; Megatron-LM issue #673): wrong when the counts differ,
    and 0/0 = NaN on a rank whose tokens are all masked, which the ring's backward then carries to
    every rank's dK and dV (Megatron-LM issue #1764).
    "global_count": each rank divides its sum by the count all-reduced over the cp ranks.
    Returns, per way, the loss (summed over ranks), this rank's masked sum and count, the max abs
    gradient error and whether any NaN. The per-token l_t is a test function with a random U: the
    loss's sign and size mean nothing; what holds by construction is that the per-rank mean is the
    mean of the ranks' own means, sum_r (S_r / n_r) / cp, and one process's sum_r S_r / sum_r n_r,
    which weight a token on rank r by 1/(cp n_r) and 1/N: they differ whenever the n_r differ
    (unless, by chance, every rank's own mean is the same).
    """
    q, k, v, u = methods.inputs(batch, heads, heads, seq_len, head_dim, launch.device())
    m = (torch.arange(seq_len) < valid_tokens).to(q.dtype).to(q.device)   # (T,) loss mask
    ref, leaves = methods.reference(q, k, v, causal=True)
    ((ref * u).sum((0, 1, 3)) * m).sum().div(m.sum()).backward()
    table = methods.layout(world_size, seq_len, "contiguous")
    rows = methods.rows_of(table[rank]).to(q.device)
    out = {}
    for way in ("per_rank_mean", "global_count"):
        mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
        o = ra.ring_attention(*mine, table, causal=True)
        local = ((o * u[:, :, rows]).sum((0, 1, 3)) * m[rows]).sum()
        count = m[rows].sum()
        if way == "per_rank_mean":
            loss = local / count / world_size     # 0/0 where this rank has no unmasked token
        else:
            total = count.clone()
            comm.all_reduce(total)                # the global number of unmasked tokens
            loss = local / total
        loss.backward()
        reported = loss.detach().clone()
        comm.all_reduce(reported)
        # torch's max keeps a NaN (Python's max(0.1, nan) would drop it, depending on the order)
        err = torch.stack([(t.grad - r.grad[:, :, rows]).abs().max() for t, r in zip(mine, leaves)]).max()
        out[way] = {"loss": reported.item(), "local_count": count.item(), "local_sum": local.item(),
                    "grad_error": err.item(),
                    "local_loss_nan": bool(torch.isnan(loss).item()),
                    "grad_nan": any(bool(torch.isnan(t.grad).any()) for t in mine)}
    out["reference_loss"] = ((ref * u).sum((0, 1, 3)) * m).sum().div(m.sum()).item()
    return out


def empty_row(safe):
    """A query whose keys are all masked (a padded row): the softmax normaliser is 0/0 unless guarded.

    Returns (output, lse) of one tile; ``safe=False`` is the unguarded exp(s - max) of a row of -inf.
    """
    q, k, v = torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4)
    mask = torch.tensor([[True, True], [False, False]])              # query 1 may see no key
    o, lse = ra.tile_forward(q, k, v, mask, 0.5, safe=safe)
    o2, lse2 = ra.merge(torch.zeros_like(o), torch.full_like(lse, ra.NEG_INF), o, lse)
    return {"output": o2[0, 0].tolist(), "lse": lse2[0, 0].tolist()}
