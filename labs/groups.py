"""Every process group a lab needs, derived from one rank grid (chapters 2 to 14).

    grid = torch.arange(world_size).view(dp, pp, tp)

tp is the fastest-varying axis, so a tensor-parallel group is a run of consecutive ranks: on a GPU
box those are the GPUs of one node, joined by NVLink (Megatron-LM's placement, Narayanan et al.
2021, arXiv 2104.04473). The degrees are checked here and nowhere else.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

AXES = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int

    @property
    def world_size(self):
        return self.dp * self.pp * self.tp

    def grid(self):
        return torch.arange(self.world_size).view(self.dp, self.pp, self.tp)

    def coords(self, rank):
        """(dp, pp, tp) coordinates of a global rank."""
        d, rest = divmod(rank, self.pp * self.tp)
        p, t = divmod(rest, self.tp)
        return {"dp": d, "pp": p, "tp": t}

    def groups(self, axis):
        """The rank lists of every group along ``axis``: ranks that differ only in that coordinate."""
        dim = AXES.index(axis)
        moved = self.grid().movedim(dim, -1)
        return moved.reshape(-1, moved.shape[-1]).tolist()


def layout(world_size, tp=1, pp=1, dp=None):
    """Check the degrees and fill in dp; one sentence says what to change when they do not fit."""
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)) + ((("dp", dp),) if dp else ()):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                         f"choose tp and pp whose product divides {world_size}.")
    dp_fit = world_size // (tp * pp)
    if dp is not None and dp != dp_fit:
        raise ValueError(f"dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} does not equal world_size "
                         f"{world_size}; use dp={dp_fit} or change the world size.")
    return Layout(dp_fit, pp, tp)


class Groups:
    """This rank's process groups and pipeline neighbours, made inside a running job.

    Every rank must create every group, in the same order, even those it is not part of:
    ``new_group`` is itself a collective.
    """

    def __init__(self, lay):
        if dist.get_world_size() != lay.world_size:
            raise ValueError(f"the job has {dist.get_world_size()} ranks but the layout needs "
                             f"{lay.world_size}; launch with world_size={lay.world_size}.")
        self.layout = lay
        self.rank = dist.get_rank()
        self.coords = lay.coords(self.rank)
        for axis in AXES:
            for ranks in lay.groups(axis):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    setattr(self, axis, group)
                    setattr(self, f"{axis}_ranks", ranks)
        stage = self.coords["pp"]
        self.pp_prev = self.pp_ranks[stage - 1] if stage > 0 else None
        self.pp_next = self.pp_ranks[stage + 1] if stage < lay.pp - 1 else None
