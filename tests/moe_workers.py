"""Chapter 7's spawned test workers: one run of 4 ranks serves every multi-process check of the
chapter (tests/test_moe.py), and a layer with a plausible bug shows that the checks catch it."""
import torch

from labs.expert_parallel import a2a_tail, dropless, ep_dp, ep_tp, moe, moe_check, node_dispatch


class UnsortedDispatchMoE(moe.ExpertParallelMoE):
    """The bug: rows sent in token order while the split sizes describe them by expert. Every rank
    still receives the right number of rows (and bytes); they are the wrong tokens."""

    def order(self, e):
        return torch.arange(len(e), device=e.device)


def unsorted_check(rank, world_size, **kwargs):
    return moe_check.check_layer(rank, world_size, layer_cls=UnsortedDispatchMoE, **kwargs)


def suite(rank, world_size, skews=(0.0, 1.0, 1.5)):
    """Every 4-rank lab of the chapter, one after the other on the same ranks."""
    return {"layer_cf1": moe_check.check_layer(rank, world_size, 24, 16, 12, 2, 1.0),
            "layer_node_limited": moe_check.check_layer(rank, world_size, 32, 16, 16, 4, None, 0, (8, 1)),
            "layer_grouped": dropless.check_grouped(rank, world_size, tokens=24),
            "layer_unsorted": unsorted_check(rank, world_size, tokens=24),
            "node": node_dispatch.compare(rank, world_size),
            "ep_dp": ep_dp.check(rank, world_size),
            "ep_tp": ep_tp.check(rank, world_size),
            "tail": a2a_tail.sent_bytes(rank, world_size, skews, batches=2)}
