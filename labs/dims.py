"""The degrees of a layout, checked once: every group, mesh and placement comes from here (chapters 2 to 14).

Modelled on torchtitan's ``ParallelDims`` (pytorch/torchtitan, torchtitan/distributed/parallel_dims.py):
the degrees dp, tp, pp, cp and ep, validated in one place, with the world size, the coordinates of a
rank, the rank lists of every group (combined ones such as dp x cp included), the DeviceMesh's dimensions
(`mesh_dims`; `labs.groups.device_mesh` builds it) and the link tier each group sits on (`tier`).

Ranks fill the grid with the first axis of ``order`` varying fastest. The default is Llama 3's
[TP, CP, PP, DP] (Llama Team 2024, arXiv 2407.21783, §3.3.2), with the expert group inside the
data-parallel one, between CP and PP (DeepSeek-AI 2024, arXiv 2412.19437, §3.2: EP 64 over 8 nodes):

    rank = t + tp (c + cp (e + ep (p + pp d')))      t, c, e, p, d' the tp, cp, ep, pp, dp/ep coordinates

so a tensor-parallel group is a run of consecutive ranks, the GPUs of one node on a GPU box
(Megatron-LM's placement, Narayanan et al. 2021, arXiv 2104.04473). ep divides dp: the data-parallel
group of a dense weight is the ep ranks times the dp/ep beyond pp (``edp``, the ranks holding the same
experts: Megatron Core's expert-data-parallel group). HSDP (chapter 3) splits dp into ``dp_replicate``
(slowest) x ``dp_shard``.

``fold_ep``: Megatron-Core's MoE parallel folding (Liu et al. 2025, arXiv 2504.14960; the ETP = 1 column of
the Megatron-MoE-ModelZoo tables): the expert layers get a grid of their own over the same ranks. A stage's
tp x cp x dp ranks, in grid order, are cut into runs of ep consecutive ranks (an expert group; the
experts are not split by tp) and ``edp`` is the ranks at the same place in every run. ep then divides
tp x cp x dp rather than dp, so EP 32 runs beside TP 2 and DP 16, and EP 8 beside CP 8 with DP 1.

The placement rule (chapter 11): a group sits inside one node of G GPUs exactly when its first and
last rank do; a synchronous step waits for its slowest group, so one straddling group puts the axis
on the slow tier. The group-by-group count (`group_nodes`) decides; "Delta N <= G" does not (tp = 1,
cp = 3 on nodes of 4: the group [3, 4, 5] straddles).
"""
import math
from dataclasses import dataclass

ORDER = ("tp", "cp", "ep", "pp", "dp")     # fastest-varying first
DEGREES = ("dp", "tp", "pp", "cp", "ep", "dp_replicate")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1                # expert parallelism, carved out of dp (or folded: fold_ep)
    dp_replicate: int = 1      # HSDP: dp = dp_replicate x dp_shard
    order: tuple = ORDER
    fold_ep: bool = False      # experts on their own grid over tp x cp x dp (Megatron-Core, ETP = 1)

    def __post_init__(self):
        for name in DEGREES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        order = tuple(self.order)
        if "ep" not in order and self.ep == 1:   # a four-axis order: ep = 1 sits anywhere
            order = (order[:order.index("pp")] + ("ep",) + order[order.index("pp"):] if "pp" in order
                     else order)
        if sorted(order) != sorted(ORDER):
            raise ValueError(f"order must list each of {', '.join(ORDER)} once (ep may be left out "
                             f"when ep = 1), got {tuple(self.order)}.")
        object.__setattr__(self, "order", order)
        if not isinstance(self.fold_ep, bool):
            raise ValueError(f"fold_ep must be True or False, got {self.fold_ep!r}.")
        if self.fold_ep and (self.tp * self.cp * self.dp) % self.ep:
            raise ValueError(f"ep = {self.ep} does not divide tp*cp*dp = {self.tp * self.cp * self.dp}: "
                             "folded experts split over a stage's tp x cp x dp ranks; choose an ep that "
                             "divides it.")
        if not self.fold_ep and self.dp % self.ep:
            raise ValueError(f"ep = {self.ep} does not divide dp = {self.dp}: the experts split "
                             "over ranks of the data-parallel group; choose an ep that divides dp "
                             "(or fold_ep=True, Megatron-Core's folding over tp x cp x dp).")
        if self.dp % self.dp_replicate:
            raise ValueError(f"dp_replicate = {self.dp_replicate} does not divide dp = {self.dp} "
                             "(HSDP: dp = dp_replicate x dp_shard); choose a divisor of dp.")
        if self.fold_ep and self.ep == 1:
            raise ValueError("fold_ep needs ep > 1: with ep = 1 there are no experts to fold.")
        if self.ep > 1 and self.dp_replicate > 1:
            raise ValueError("expert parallelism inside HSDP is not modelled: give ep or "
                             "dp_replicate, not both.")

    @classmethod
    def build(cls, world_size, *, dp=None, **degrees):
        """The layout of ``world_size`` ranks with dp filled in (or checked, when given)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
        # tp, pp, cp first
        probe = cls(**{k: v for k, v in degrees.items() if k not in ("ep", "dp_replicate")})
        inner = probe.tp * probe.cp * probe.pp
        names = "*".join(a for a in ("tp", "cp", "pp") if a != "cp" or probe.cp > 1)
        values = "*".join(str(getattr(probe, a)) for a in names.split("*"))
        if world_size % inner:
            raise ValueError(f"world_size {world_size} is not divisible by {names} = {values} = {inner}; "
                             f"choose degrees whose product divides {world_size}.")
        fit = world_size // inner
        if dp is not None and dp != fit:
            raise ValueError(f"dp*{names} = {dp}*{values} = {dp * inner} does not equal world_size "
                             f"{world_size}; use dp={fit} or change the world size.")
        return cls(dp=fit, **degrees)

    def __repr__(self):   # the degrees that differ from 1 (and the order, when it is not Llama 3's)
        shown = [f"{a}={getattr(self, a)}" for a in DEGREES if getattr(self, a) != 1 or a == "dp"]
        shown += ["fold_ep=True"] if self.fold_ep else []
        return f"ParallelDims({', '.join(shown + ([f'order={self.order}'] if self.order != ORDER else []))})"

    @property
    def world_size(self):
        return self.dp * self.tp * self.pp * self.cp

    @property
    def etp(self):
        """The experts' tensor-parallel degree: tp, or 1 when they are folded (`fold_ep`)."""
        return 1 if self.fold_ep else self.tp

    @property
    def dp_shard(self):
        return self.dp // self.dp_replicate

    def degrees(self):
        """{axis: degree} of the four axes every layout has, and ep (for tables and JSON); HSDP's
        dp_replicate too where dp is split into replicas, so that two HSDP splits print apart."""
        out = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}
        return {**out, "dp_replicate": self.dp_replicate} if self.dp_replicate > 1 else out

    # ---- the grid ---------------------------------------------------------------------------------
    def atoms(self):
        """[(name, size)] of the grid's axes, fastest first; the dp slot holds dp / ep ranks, split
        into shard (faster) and replicate parts (folded experts take no axis: `fold_ep`)."""
        carved = 1 if self.fold_ep else self.ep
        slots = {"tp": [("tp", self.tp)], "cp": [("cp", self.cp)], "ep": [("ep", carved)],
                 "pp": [("pp", self.pp)],
                 "dp": [("dp_shard", self.dp // (carved * self.dp_replicate)),
                        ("dp_replicate", self.dp_replicate)]}
        return [atom for axis in self.order for atom in slots[axis]]

    # the logical groups, as sets of atoms
    GROUPS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "ep": ("ep",),
              "dp": ("ep", "dp_shard", "dp_replicate"), "edp": ("dp_shard", "dp_replicate"),
              "dp_shard": ("ep", "dp_shard"), "dp_replicate": ("dp_replicate",)}

    def _atoms_of(self, axis):
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        if self.fold_ep and {"ep", "edp"} & set(names):
            raise ValueError(f"folded experts have a grid of their own: {axis!r} cannot combine "
                             "ep or edp with the other axes; ask for 'ep' or 'edp' alone.")
        out = set()
        for name in names:
            if name not in self.GROUPS:
                raise ValueError(f"unknown group {name!r}; groups are {', '.join(self.GROUPS)}.")
            out |= set(self.GROUPS[name])
        return out

    def size(self, axis):
        """Ranks in one group of ``axis`` (a name or a tuple of names)."""
        if self.fold_ep and axis in ("ep", "edp"):
            return self.ep if axis == "ep" else self.tp * self.cp * self.dp // self.ep
        chosen = self._atoms_of(axis)
        return math.prod(n for a, n in self.atoms() if a in chosen)

    def stride(self, axis):
        """Distance Delta in global rank between neighbours in a group of ``axis``: the product of the
        faster axes. Defined when the group spans one axis of the grid (its ranks r0 + Delta k)."""
        if self.fold_ep and axis in ("ep", "edp"):
            raise ValueError(f"a folded {axis} group is cut from tp x cp x dp; it has no single stride.")
        chosen, out, found = self._atoms_of(axis), 1, []
        for a, n in self.atoms():
            if a in chosen and (n > 1 or not found):
                found.append((a, n, out))
            out *= n
        wide = [f for f in found if f[1] > 1]
        if len(wide) > 1:
            raise ValueError(f"a group of {axis!r} spans {len(wide)} axes of the grid; it has no "
                             "single stride.")
        return (wide or found)[0][2]

    def groups(self, axis):
        """The rank lists of every group along ``axis`` (a name, or a tuple of names): ranks that
        differ only in those coordinates, each list ascending, the lists by their first rank.
        ("dp", "cp") is the group that averages gradients under context parallelism."""
        return self._grouped(axis)

    def _grouped(self, axis):
        """`groups`, computed: the grid's ranks with the coordinates of ``axis`` varying inside a row."""
        if self.fold_ep and axis in ("ep", "edp"):     # runs of ep of each stage's tp x cp x dp ranks
            stages, ep = self._grouped(("tp", "cp", "dp")), self.ep
            if axis == "ep":
                return [row[k:k + ep] for row in stages for k in range(0, len(row), ep)]
            return [row[j::ep] for row in stages for j in range(ep)]
        chosen, stride, inside, outside = self._atoms_of(axis), 1, [], []
        for a, n in self.atoms():                    # fastest first
            (inside if a in chosen else outside).append((n, stride))
            stride *= n
        return [[first + k for k in _offsets(inside)] for first in _offsets(outside)]

    def coords(self, rank):
        """{group: index of ``rank`` in its group} for tp, cp, pp, dp (and ep, edp, dp_shard,
        dp_replicate when they are split out)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not one of the {self.world_size} ranks of the layout.")
        at, stride = {}, 1
        for a, n in self.atoms():
            at[a], stride = (rank // stride) % n, stride * n
        names = ["dp", "pp", "cp", "tp"] + (["ep", "edp"] if self.ep > 1 else []) + \
                (["dp_shard", "dp_replicate"] if self.dp_replicate > 1 else [])
        out = {}
        if self.fold_ep:
            names = [n for n in names if n not in ("ep", "edp")]
            run = self.groups(("tp", "cp", "dp"))
            at_stage = next(g for g in run if rank in g).index(rank)
            out["ep"], out["edp"] = at_stage % self.ep, at_stage // self.ep
        for name in names:
            index, scale = 0, 1
            for a, n in self.atoms():           # faster atoms are the less significant digits
                if a in self.GROUPS[name]:
                    index, scale = index + at[a] * scale, scale * n
            out[name] = index
        return out

    # ---- placement (chapter 11) -------------------------------------------------------------------
    def group_nodes(self, axis, gpus_per_node):
        """Per group of ``axis``, how many units of ``gpus_per_node`` ranks its ranks touch."""
        _positive("gpus_per_node", gpus_per_node)
        out = []
        for row in self._grouped(axis):                          # ascending rows: count the changes
            nodes = [r // gpus_per_node for r in row]
            out.append(1 + sum(a != b for a, b in zip(nodes, nodes[1:])))
        return out

    def tier(self, axis, gpus_per_node):
        """"intra" when every group of ``axis`` is inside one node, else "inter"."""
        return "intra" if max(self.group_nodes(axis, gpus_per_node)) == 1 else "inter"

    # ---- the DeviceMesh's dimensions (`labs.groups.device_mesh` builds it) ---------------------------
    def mesh_dims(self):
        """[(name, size)] of the DeviceMesh's dimensions (`labs.groups.device_mesh`), slowest first: tp,
        pp and dp, which every lab's mesh has; cp, ep and HSDP's replicate part only when they are above
        1 (a dimension of size 1 costs a process group per rank); dp's remaining part named dp, edp
        (ep > 1) or dp_shard (HSDP)."""
        if self.fold_ep:
            raise ValueError("folded experts are not a dimension of one DeviceMesh (Megatron-Core builds "
                             "a second grid for them): take their ranks from groups('ep') and "
                             "groups('edp').")
        shard = "edp" if self.ep > 1 else "dp_shard" if self.dp_replicate > 1 else "dp"
        out = []
        for a, n in reversed(self.atoms()):
            if a in ("cp", "ep", "dp_replicate") and n == 1:
                continue
            out.append((shard if a == "dp_shard" else a, n))
        return out


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _offsets(parts):
    """Every sum of k * stride over ``parts`` [(n, stride)], fastest first, 0 <= k < n; the slowest
    part varies slowest, so the sums ascend."""
    out = [0]
    for n, stride in reversed(parts):
        out = [o + k * stride for o in out for k in range(n)]
    return out
