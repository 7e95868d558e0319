"""Chapter 6: all-gather context parallelism, as in Llama 3's long-context training.

Llama Team, AI @ Meta 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), §3.3.2, "Context
parallelism": the sequence is cut into 2 x cp chunks and rank i keeps chunks i and 2cp-1-i
(load balance under the causal mask); K and V are all-gathered, and each rank computes the
attention of its local Q chunks against the whole K and V. The paper chose this over a ring
because the all-gather is simple and flexible for masks, and because with GQA the gathered K and
V are much smaller than Q, so the exposed all-gather latency is small.

Backward: the all-gather's adjoint is a reduce-scatter, handing every rank the sum of all ranks'
contributions to its own K and V rows. Both run as hand rings (`hand_ring.hand_collectives()`:
counted messages). The gathered K and V are kept for backward here; Megatron-LM's context
parallelism keeps only this rank's chunk and gathers again in backward (its API guide,
docs/source/api-guide/context_parallel.rst), 2(cp-1) more blocks backward for T/cp tokens' memory.
"""
import torch
import torch.distributed as dist

from labs.measure import comm
from labs.data_parallel import hand_ring
from labs.context_parallel import ring_attention as ra


class GatherSequence(torch.autograd.Function):
    """x (B, k, T/cp, d) -> (B, k, T, d), rows in rank order; backward: reduce-scatter of dx."""

    @staticmethod
    def forward(ctx, x, group):
        n = dist.get_world_size(group)
        ctx.group = group
        rows = x.permute(2, 0, 1, 3).contiguous()                   # (T/cp, B, k, d): rows first
        out = rows.new_empty((n * rows.shape[0],) + rows.shape[1:])  # (T, B, k, d)
        with hand_ring.hand_collectives():
            comm.all_gather(out, rows, group=group)
        return out.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, g):
        n = dist.get_world_size(ctx.group)
        rows = g.permute(2, 0, 1, 3).contiguous()                   # (T, B, k, d)
        mine = rows.new_empty((rows.shape[0] // n,) + rows.shape[1:])
        with hand_ring.hand_collectives():
            comm.reduce_scatter(mine, rows, group=ctx.group)        # sum over the ranks that read my rows
        return mine.permute(1, 2, 0, 3), None


def allgather_attention(q, k, v, table, causal=True, group=None, work=None, block=None):
    """This rank's attention output (B, a, T/cp, d) against the all-gathered K and V."""
    r = dist.get_rank(group)
    k_all, v_all = GatherSequence.apply(k, group), GatherSequence.apply(v, group)  # (B, k, T, d)
    everyone = [c for chunks in table for c in chunks]             # gathered rows, rank by rank
    out, _ = ra.attend(q, k_all, v_all, table[r], everyone, causal, work, block)
    return out


def allgather_bytes(kv_block_bytes, cp):
    """Counted bytes one rank sends: a ring all-gather of K and of V, (cp-1) blocks each, forward;
    a ring reduce-scatter of dK and of dV, (cp-1) blocks each, backward."""
    return {"forward": 2 * (cp - 1) * kv_block_bytes, "backward": 2 * (cp - 1) * kv_block_bytes}
