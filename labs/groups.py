"""Every process group a lab needs, derived from one rank grid (chapters 2 to 14).

    grid = torch.arange(world_size).view(dp, pp, cp, tp)

tp is the fastest-varying axis, so a tensor-parallel group is a run of consecutive ranks: on a GPU
box those are the GPUs of one node, joined by NVLink (Megatron-LM's placement, Narayanan et al.
2021, arXiv 2104.04473). Context parallelism (cp, chapter 6; 1 unless a lab asks for it) sits next
to it, then pp, then dp, the slowest: Llama 3's order [TP, CP, PP, DP] (Dubey et al. 2024, arXiv
2407.21783, section 3.3.2). The degrees are checked here and nowhere else.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

AXES = ("dp", "pp", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    cp: int = 1

    @property
    def world_size(self):
        return self.dp * self.pp * self.cp * self.tp

    def grid(self):
        return torch.arange(self.world_size).view(self.dp, self.pp, self.cp, self.tp)

    def coords(self, rank):
        """(dp, pp, cp, tp) coordinates of a global rank."""
        d, rest = divmod(rank, self.pp * self.cp * self.tp)
        p, rest = divmod(rest, self.cp * self.tp)
        c, t = divmod(rest, self.tp)
        return {"dp": d, "pp": p, "cp": c, "tp": t}

    def groups(self, axis):
        """The rank lists of every group along ``axis`` (a name, or a tuple of names): ranks that
        differ only in those coordinates. ("dp", "cp") is the group that averages gradients under
        context parallelism: each cp rank saw other tokens of the same sequences."""
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        dims = [AXES.index(a) for a in names]
        moved = self.grid().movedim(dims, list(range(-len(dims), 0)))
        size = 1
        for a in names:
            size *= getattr(self, a)
        return moved.reshape(-1, size).tolist()


def layout(world_size, tp=1, pp=1, dp=None, cp=1):
    """Check the degrees and fill in dp; one sentence says what to change when they do not fit."""
    checked = (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp)) + ((("dp", dp),) if dp else ())
    for name, value in checked:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    names, degrees = ("tp*cp*pp", f"{tp}*{cp}*{pp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
    if world_size % (tp * cp * pp):
        raise ValueError(f"world_size {world_size} is not divisible by {names} = {degrees} = {tp * cp * pp}; "
                         f"choose degrees whose product divides {world_size}.")
    dp_fit = world_size // (tp * cp * pp)
    if dp is not None and dp != dp_fit:
        raise ValueError(f"dp*{names} = {dp}*{degrees} = {dp * tp * cp * pp} does not equal "
                         f"world_size {world_size}; use dp={dp_fit} or change the world size.")
    return Layout(dp_fit, pp, tp, cp)


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
        # cp and dp_cp (dp and cp together) only when a lab splits the sequence: new_group is a
        # collective, and every other lab would pay for groups it never uses
        axes = [a for a in AXES if a != "cp" or lay.cp > 1] + ([("dp", "cp")] if lay.cp > 1 else [])
        for axis in axes:
            name = axis if isinstance(axis, str) else "_".join(axis)
            for ranks in lay.groups(axis):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    setattr(self, name, group)
                    setattr(self, f"{name}_ranks", ranks)
        stage = self.coords["pp"]
        self.pp_prev = self.pp_ranks[stage - 1] if stage > 0 else None
        self.pp_next = self.pp_ranks[stage + 1] if stage < lay.pp - 1 else None
