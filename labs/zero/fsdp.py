"""Chapter 3: ZeRO stage 3 as a hand-built FSDP that wraps any nn.Module by units, and FSDP2 beside it.

ZeRO-3 (Rajbhandari et al. 2019, arXiv 1910.02054, section 5.3) keeps only a 1/N shard of every
weight on each rank and gathers a layer's weights just before the layer needs them; PyTorch FSDP
(Zhao et al. 2023, arXiv 2304.11277, section 3) does it per *unit*, a submodule whose parameters
are flattened together. For each unit:
- before its forward: all-gather the full weights (cast to the compute dtype); after: free them;
- before its backward (a hook on its outputs' gradients): all-gather again; after (a function on
  its inputs whose backward runs once the unit's input gradients exist): reduce-scatter the
  weight gradients, keep this rank's shard, free the full weights and gradients.
So at any moment a rank holds the shards of everything plus the full weights of about one unit,
instead of the whole model. The root (the model itself) is the last unit and owns the parameters
no other unit claims, tied weights used by several units included.

    fsdp = HandFSDP(model, units=list(model.blocks), compute_dtype=torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)   # the parameters are now the shards
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

The training loop is the ordinary one; ``model.parameters()`` yields this rank's pieces of the
fp32 shards (1-D, under the original names), as FSDP2's ``fully_shard`` yields DTensor shards.
``compute_dtype`` plays FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``: the shards stay in
their own dtype (the fp32 master) and forward and backward run in the compute dtype; gradients are
reduced in the compute dtype and stored in the shard's.

Below it, `fully_shard_units`: FSDP2 on the same units. `labs.zero.unseen_model` trains a model none of
the hand pieces was written for under this FSDP, the sharded optimizer and FSDP2.
"""
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from labs.measure import comm


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None,) + grads


class Unit:
    """The parameters one module owns, flattened into one padded buffer; this rank keeps 1/N of it."""

    def __init__(self, fsdp, module, owned, compute_dtype):
        params = list(owned)
        if len({p.dtype for p in params}) > 1:
            raise ValueError(f"unit {type(module).__name__} mixes parameter dtypes; give it one dtype.")
        # keep the places and shapes, not the parameters: their full weights must be freed
        self.fsdp, self.module, self.where = fsdp, module, list(owned.values())
        self.shapes, self.dtype = [p.shape for p in params], params[0].dtype
        n, rank, dtype, device = fsdp.n, fsdp.rank, params[0].dtype, params[0].device
        self.start = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // n) * n
        self.shard = self.padded // n
        self.lo = rank * self.shard
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for p, s in zip(params, self.start):
            flat[s:s + p.numel()].copy_(p.detach().reshape(-1))
        self.flat_shard = flat[self.lo:self.lo + self.shard].clone()  # all this rank keeps
        del flat
        # this rank's piece of each parameter (the padding goes with the last one): what the
        # optimizer steps, one tensor per parameter, so a parameter without a gradient is skipped
        ends, hi = self.start[1:] + [self.padded], self.lo + self.shard
        self.pieces, self.ranges = [], []
        for p, s, end in zip(params, self.start, ends):
            a = min(max(s, self.lo), hi)          # empty where this rank holds none of p
            b = max(min(end, hi), a)
            self.ranges.append((a - self.lo, b - self.lo))
            self.pieces.append(torch.nn.Parameter(self.flat_shard[a - self.lo:b - self.lo],
                                                  requires_grad=p.requires_grad))
        # the full weights in the compute dtype: one buffer, freed (0 bytes) whenever not in use
        self.compute_dtype = compute_dtype or dtype
        self.full = torch.empty(self.padded, dtype=self.compute_dtype, device=device)
        self.unsharded = [torch.nn.Parameter(self.full[s:s + p.numel()].view(p.shape),
                                             requires_grad=p.requires_grad)
                          for p, s in zip(params, self.start)]
        self.full.untyped_storage().resize_(0)
        self.gathered, self.in_backward, self.done = False, False, False
        self._swap(self.pieces)
        for piece, (a, _), s in zip(self.pieces, self.ranges, self.start):
            piece.offset = self.lo + a - s   # where the piece starts in its parameter's flat view

    def _swap(self, tensors):
        """Point every place the module uses a parameter at ``tensors`` (pieces or full weights)."""
        for places, t in zip(self.where, tensors):
            for module, name in places:
                module._parameters[name] = t

    @torch.no_grad()
    def gather(self):
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        # through .data: refilling the weights that backward saved is not an in-place change to them
        comm.all_gather(self.full.data, self.flat_shard.to(self.compute_dtype), group=self.fsdp.group)
        self.gathered = True
        now = sum(u.gathered for u in self.fsdp.units)
        self.fsdp.max_units_gathered = max(self.fsdp.max_units_gathered, now)

    def free(self):
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    # -- hooks ------------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        self.gather()
        self._swap(self.unsharded)
        flat, spec = tree_flatten((args, kwargs))
        if self.compute_dtype != self.dtype:  # as FSDP2's cast_forward_inputs
            flat = [t.to(self.compute_dtype) if torch.is_tensor(t) and t.is_floating_point() else t
                    for t in flat]
        idx = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if idx and torch.is_grad_enabled():
            for i, t in zip(idx, _PostBackward.apply(self, *(flat[i] for i in idx))):
                flat[i] = t
        return tree_unflatten(flat, spec)

    def post_forward(self, module, args, output):
        self.free()
        self._swap(self.pieces)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self.pre_backward)
        return output

    def pre_backward(self, grad):
        if not self.in_backward:
            self.in_backward = True
            self.fsdp.queue_end_of_backward()
            self.gather()

    @torch.no_grad()
    def post_backward(self):
        """Reduce-scatter the gradients this unit's parameters got; free the full weights."""
        if self.done:
            return
        self.done = True
        if not self.fsdp.requires_gradient_sync:  # no sync: autograd sums the full grads in place
            self.free()
            return
        got = [i for i, u in enumerate(self.unsharded) if u.grad is not None]
        if got:  # ranks agree on this (FSDP2 requires it too), so they all call the collective
            flat = torch.zeros(self.padded, dtype=self.compute_dtype, device=self.full.device)
            for i in got:
                u = self.unsharded[i]
                flat[self.start[i]:self.start[i] + u.numel()].copy_(u.grad.reshape(-1))
                u.grad = None
            out = torch.empty(self.shard, dtype=self.compute_dtype, device=flat.device)
            comm.reduce_scatter(out, flat, group=self.fsdp.group)
            del flat
            out.div_(self.fsdp.n)
            for i in got:
                piece, (a, b) = self.pieces[i], self.ranges[i]
                g = out[a:b].to(piece.dtype)
                piece.grad = g if piece.grad is None else piece.grad.add_(g)
        self.free()


def _owners(model, units):
    """{unit module: {parameter: [(module, name), ...]}}: the innermost unit that uses it, or the
    root when several units use it (a tied embedding and head)."""
    unit_set = set(map(id, units))
    found = {}   # id(param) -> (param, set of owning units, places)

    def walk(module, owner):
        owner = module if id(module) in unit_set else owner
        for name, p in module._parameters.items():
            if p is not None:
                entry = found.setdefault(id(p), (p, set(), []))
                entry[1].add(owner)
                entry[2].append((module, name))
        for child in module._modules.values():
            if child is not None:
                walk(child, owner)

    walk(model, model)
    out = {u: {} for u in units}
    for p, owners, places in found.values():
        out[next(iter(owners)) if len(owners) == 1 else model][p] = places
    return out


class HandFSDP:
    """ZeRO-3 by units over any ``nn.Module``: modifies ``model`` in place (see the module docstring).

    ``units``: submodules, each gathered and freed on its own (e.g. every transformer block); the
    model itself is always the last unit. ``units=()`` gathers the whole model at once (the naive
    ZeRO-3 the per-unit version improves on). All ranks must run the same units in the same order
    and agree on which parameters get gradients, as with FSDP2.
    """

    def __init__(self, model, units=(), compute_dtype=None, group=None):
        units = [u for u in units if u is not model]
        inside = set(map(id, model.modules()))
        if any(id(u) not in inside for u in units):
            raise ValueError("every unit must be a submodule of the model being wrapped.")
        self.model, self.group, self._queued, self.units = model, group, False, []
        self.requires_gradient_sync = True
        self.max_units_gathered = 0   # the most units holding full weights at once, ever
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        owners = _owners(model, units + [model])
        self.units = [Unit(self, m, owners[m], compute_dtype) for m in units + [model] if owners[m]]
        for u in self.units:
            u.module.register_forward_pre_hook(u.pre_forward, with_kwargs=True)
            u.module.register_forward_hook(u.post_forward)

    def set_requires_gradient_sync(self, requires_gradient_sync):
        """FSDP2's switch of the same name (FSDP1's ``no_sync``): with False, backward skips the
        reduce-scatter and each unit keeps its full gradients on its unsharded parameters, where
        autograd sums the micro-batches; the next backward with True reduce-scatters the sum once.
        The price is the full gradients held in between, as PyTorch's documentation warns."""
        self.requires_gradient_sync = requires_gradient_sync

    def queue_end_of_backward(self):
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True

    def _end_of_backward(self):
        """Units whose post-backward hook could not fire (the root: integer inputs) finish here."""
        for u in self.units:  # the same order on every rank
            if u.in_backward:
                u.post_backward()
            u.in_backward = u.done = False
        self._queued = False

    @torch.no_grad()
    def full_parameters(self):
        """{name: full weights in the shard dtype}, all-gathered (for checks; not counted)."""
        out = {}
        for u in self.units:
            flat = u.flat_shard.new_empty(u.padded)
            comm.all_gather_single(flat, u.flat_shard, group=self.group)
            for shape, s, places in zip(u.shapes, u.start, u.where):
                out[param_name(self.model, places[0])] = flat[s:s + shape.numel()].view(shape).clone()
        return out


def param_name(model, place):
    """The dotted name in ``model`` of the parameter at ``place``, a (module, attribute name) pair."""
    module, name = place
    prefix = next(n for n, m in model.named_modules() if m is module)
    return f"{prefix}.{name}" if prefix else name


def fully_shard_units(net, units, mesh, param_dtype=None, cpu_offload=False, hand_comm=False,
                      reshard_after_forward=None):
    """PyTorch's FSDP2 on the same units: ``fully_shard`` each unit, then the root.
    ``reshard_after_forward`` goes to the units' ``fully_shard`` (None: FSDP2's default, True).

    ``hand_comm=True`` routes FSDP2's all-gathers and reduce-scatters through `labs.measure.comm` with
    FSDP2's own extension points (``set_custom_all_gather``, ``set_custom_reduce_scatter``), so
    inside ``hand_ring.hand_collectives()`` they are hand rings of counted messages."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    policy = {"mesh": mesh}
    if param_dtype is not None:
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype)
    if cpu_offload:
        policy["offload_policy"] = CPUOffloadPolicy()
    # one unit each: gathered just before it runs, freed after; the root last
    for unit in list(units) + [net]:
        keep = {} if unit is net or reshard_after_forward is None else {"reshard_after_forward":
                                                                         reshard_after_forward}
        fully_shard(unit, **policy, **keep)
        if hand_comm:
            unit.set_custom_all_gather(CommAllGather())
            unit.set_custom_reduce_scatter(CommReduceScatter())
    return net


class CommAllGather:
    """FSDP2's all-gather (its ``AllGather`` interface: ``allocate`` and a call) through
    `labs.measure.comm`."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return comm.all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


class CommReduceScatter(CommAllGather):
    """FSDP2's reduce-scatter through `labs.measure.comm`; its AVG (bf16 gradients) as a SUM, then / N."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op != dist.ReduceOp.AVG:
            return comm.reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        comm.reduce_scatter(output_tensor, input_tensor, group=group)   # synchronous: the sum is complete
        output_tensor.div_(dist.get_world_size(group))
        return None
