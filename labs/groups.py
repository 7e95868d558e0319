"""Every process group a lab needs, made from one `labs.dims.ParallelDims` (chapters 2 to 14).

The degrees, their checks, the rank grid and the rank lists of every group live in `labs.dims`;
here they become ``torch.distributed`` process groups inside a running job. With Llama 3's order
[TP, CP, PP, DP] (tp fastest) a tensor-parallel group is a run of consecutive ranks: on a GPU box
the GPUs of one node, joined by NVLink.
"""
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


class Groups:
    """This rank's process groups and pipeline neighbours, made inside a running job.

    Every rank must create every group, in the same order, even those it is not part of:
    ``new_group`` is itself a collective. Attributes: ``tp``, ``pp``, ``dp`` (and ``cp`` and
    ``dp_cp``, dp and cp together, when cp > 1; ``ep`` and ``edp`` when ep > 1; ``dp_shard`` and
    ``dp_replicate`` under HSDP), each with ``<name>_ranks``; ``coords``; ``pp_prev``, ``pp_next``.
    """

    def __init__(self, dims):
        if dist.get_world_size() != dims.world_size:
            raise ValueError(f"the job has {dist.get_world_size()} ranks but the layout needs "
                             f"{dims.world_size}; launch with world_size={dims.world_size}.")
        self.dims = dims
        self.rank = dist.get_rank()
        self.coords = dims.coords(self.rank)
        # cp, dp_cp, ep, ... only when a lab splits that axis: new_group is a collective, and every
        # other lab would pay for groups it never uses
        axes = ["tp", "pp", "dp"] + (["cp", ("dp", "cp")] if dims.cp > 1 else []) + \
            (["ep", "edp"] if dims.ep > 1 else []) + \
            (["dp_shard", "dp_replicate"] if dims.dp_replicate > 1 else [])
        for axis in axes:
            name = axis if isinstance(axis, str) else "_".join(axis)
            for ranks in dims.groups(axis):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    setattr(self, name, group)
                    setattr(self, f"{name}_ranks", ranks)
        stage = self.coords["pp"]
        self.pp_prev = self.pp_ranks[stage - 1] if stage > 0 else None
        self.pp_next = self.pp_ranks[stage + 1] if stage < dims.pp - 1 else None


def device_mesh(dims, device_type=None):
    """The layout ``dims`` as a torch DeviceMesh (inside a running job of `world_size` ranks): one named
    dimension per `ParallelDims.mesh_dims` entry, and "dp" flattened from its parts when it has several, so
    ``mesh["tp"]``, ``mesh["dp"]`` and, under HSDP, ``mesh["dp_replicate", "dp_shard"]`` exist."""
    if device_type is None:
        from labs.launcher import launch
        device_type = launch.device().type
    names = dims.mesh_dims()
    mesh = init_device_mesh(device_type, tuple(n for _, n in names),
                            mesh_dim_names=tuple(a for a, _ in names))
    parts = tuple(a for a, _ in names if a in ("dp_replicate", "dp_shard", "edp", "ep"))
    if len(parts) > 1:
        mesh[parts]._flatten("dp")
    return mesh
