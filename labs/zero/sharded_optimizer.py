"""Chapter 3: ZeRO stages 0-2 as a sharded optimizer that wraps any ``torch.optim`` class.

ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054, sections 5.1-5.2) gives each of N data-parallel
ranks a 1/N shard of the optimizer state (stage 1, P_os) and of the gradients (stage 2, P_os+g).
`ShardedOptimizer(params, torch.optim.Adam, stage=1|2, lr=...)` does it as a drop-in optimizer, in
the spirit of torch's ``ZeroRedundancyOptimizer``: the training loop keeps its own forward,
backward, ``step()`` and ``zero_grad()``:

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

Stage 3 (the weights sharded too) wraps the model instead: `labs.zero.fsdp.HandFSDP`. The lab that
measures every stage on the tiny GPT is `labs.zero.stages`.
"""
import weakref

import torch
import torch.distributed as dist

from labs.measure import comm

LOW_PRECISION = (torch.bfloat16, torch.float16)


class Bucket:
    """Trainable parameters of one dtype, as views into one flat buffer padded to a multiple of N.

    Rank r owns elements [r*S, (r+1)*S) of the buffer, S = padded / N (stage 0: all of it). Its
    shard is cut into pieces, one per parameter it overlaps, so the inner optimizer sees each
    parameter's part as its own tensor and skips it when it got no gradient, as torch.optim does;
    the padding belongs to the last parameter's piece, so the pieces cover the shard exactly.
    """

    def __init__(self, params, n, rank, stage):
        dtype, device = params[0].dtype, params[0].device
        self.params, self.start = params, {}
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // n) * n
        self.shard = self.padded // n if stage >= 1 else self.padded
        self.lo = rank * self.shard if stage >= 1 else 0
        self.flat = torch.zeros(self.padded, dtype=dtype, device=device)
        offset = 0
        for p in params:
            self.start[p] = offset
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        mine = self.mine()
        # 16-bit weights get an fp32 master copy of this rank's shard (Micikevicius et al. 2018);
        # fp32 weights are their own master: the inner optimizer then steps them in place
        self.master = mine.float() if dtype in LOW_PRECISION else mine
        self.pieces = []   # (parameter, its piece of the master shard, first, last) in shard coordinates
        ends = [self.start[p] for p in params[1:]] + [self.padded]
        for p, end in zip(params, ends):
            a, b = max(self.start[p], self.lo), min(end, self.lo + self.shard)
            if a < b:
                piece = torch.nn.Parameter(self.master[a - self.lo:b - self.lo])
                self.pieces.append((p, piece, a - self.lo, b - self.lo))
        self.grad = None        # the full gradient buffer (stages 0-1 keep it; stage 2 only in flight)
        self.shard_grad = None  # stage 2: this rank's reduced shard, accumulated over micro-batches
        self.arrived, self.reduced = set(), False

    def mine(self):
        return self.flat[self.lo:self.lo + self.shard]


def _unique_trainable(params):
    seen, out = set(), []
    for p in params:
        if id(p) not in seen and p.requires_grad:  # tied weights are one Parameter: once
            seen.add(id(p))
            out.append(p)
    return out


def unit_buckets(model, units):
    """Buckets laid out like FSDP units: one per unit in backward's (reverse) order, then the rest."""
    groups = [list(u.parameters()) for u in reversed(units)]
    taken = {id(p) for g in groups for p in g}
    return groups + [[p for p in model.parameters() if id(p) not in taken]]


def make_buckets(params, bucket_numel=None):
    """Group parameters by dtype, in reverse order (backward's), into buckets of ~bucket_numel."""
    buckets, open_ = [], {}
    for p in reversed(params):
        current = open_.setdefault(p.dtype, [])
        current.append(p)
        if bucket_numel is not None and sum(q.numel() for q in current) >= bucket_numel:
            buckets.append(current)
            open_[p.dtype] = []
    return buckets + [b for b in open_.values() if b]


def frees_each_bucket(reductions):
    """Whether a stage-2 step freed every bucket's full gradient as soon as its reduction returned:
    after each reduction (``ShardedOptimizer.reductions``) the full-gradient storages still alive
    (measured by weak references, not read off ``b.grad``) are exactly the buckets still filling, to
    the byte. "Less than the whole gradient" passes a ZeRO-2 that never frees one bucket, or that
    drops it from ``b.grad`` but keeps it elsewhere until backward ends; this refuses both at that
    bucket's reduction, and at every later one."""
    return bool(reductions) and all(e["live_after"] == e["filling"] for e in reductions)


class ShardedOptimizer:
    """ZeRO stage 0 (DDP), 1 or 2 around any elementwise ``torch.optim`` optimizer class.

    - stage 0: gradients all-reduced at ``step``; every rank updates everything (DDP + optimizer);
    - stage 1: gradients reduce-scattered at ``step``, each rank's inner optimizer steps only its
      shard, the updated shards are all-gathered back into the parameters;
    - stage 2: as stage 1, but each bucket is reduce-scattered from a backward hook as soon as all
      its gradients are in (``register_post_accumulate_grad_hook``), and the full gradients are
      freed as backward goes: a rank keeps only its shard of the gradient.

    Stages 0 and 1 reduce once per optimizer step, however many micro-batches were accumulated
    (DDP's ``no_sync``); stage 2 reduce-scatters every micro-batch. Parameters are re-pointed
    into flat bucket buffers; 16-bit parameters get an fp32 master shard (the inner optimizer steps
    the master, the new weights are rounded back). Frozen parameters are left alone (replicated),
    tied weights are one parameter. The ``.grad`` of a parameter is moved into its bucket by the
    hook, so it reads None after backward. A parameter that got no gradient on this rank gets none
    in the inner optimizer either (torch.optim then skips it); ranks must agree on which those are,
    as FSDP2 requires (DDP's ``find_unused_parameters`` all-reduces a bitmap to find out).
    Update rules that need whole tensors (Adafactor's factored moments, Muon, LBFGS) are not
    elementwise and would see flat pieces: use elementwise ones (SGD, Adam, AdamW, ...).

    Arguments: ``params`` (any iterable of parameters; ranks must start from equal weights),
    ``optimizer_class`` and ``**defaults`` (its keyword arguments, e.g. ``lr``), ``stage``,
    ``bucket_numel`` (elements per bucket; None: one bucket per dtype) or ``buckets`` (lists of
    parameters, one per bucket, in the order backward completes them), ``group`` (the data-parallel
    process group), ``zero1_allreduce`` (stage 1 with an all-reduce instead of a reduce-scatter,
    as ZeRO's first DeepSpeed release did: 3 Psi per step instead of 2).
    """

    def __init__(self, params, optimizer_class, stage=1, bucket_numel=None, buckets=None, group=None,
                 zero1_allreduce=False, **defaults):
        if stage not in (0, 1, 2):
            raise ValueError(f"stage must be 0 (DDP), 1 or 2, got {stage!r}; stage 3 shards the weights "
                             "too: wrap the model with labs.zero.fsdp.HandFSDP.")
        params = _unique_trainable(params)
        if not params:
            raise ValueError("no parameter requires a gradient, so there is nothing to optimize.")
        groups = make_buckets(params, bucket_numel) if buckets is None else buckets
        groups = [_unique_trainable(b) for b in groups]
        if sorted(id(p) for b in groups for p in b) != sorted(id(p) for p in params):
            raise ValueError("buckets must hold every trainable parameter exactly once.")
        if any(len({p.dtype for p in b}) > 1 for b in groups):
            raise ValueError("a bucket must hold parameters of one dtype; bucket by dtype.")
        self.group, self.stage, self.zero1_allreduce = group, stage, zero1_allreduce
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.buckets = [Bucket(b, self.n, self.rank, stage) for b in groups if b]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.optimizer = optimizer_class([piece for b in self.buckets for _, piece, _, _ in b.pieces],
                                         **defaults)
        self.got_grad, self._reduced, self._queued = set(), None, False
        self.full_grad_peak_bytes = 0  # the most full-gradient bytes live at a reduction, `_note_live`
        self._grad_storages = {}  # full-gradient storages seen: id -> (weak reference, bytes)
        self.reductions = []  # stage 2, this step: per bucket reduced, `_note_freed`
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    # -- backward ---------------------------------------------------------------------------
    @torch.no_grad()
    def _grad_ready(self, p):
        """p.grad holds this backward's gradient: add it into its bucket and free it."""
        b = self.bucket_of[p]
        if b.grad is None:
            b.grad = torch.zeros_like(b.flat)
        start = b.start[p]
        b.grad[start:start + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None
        self.got_grad.add(p)
        if self.stage == 2:
            if not self._queued:  # once per backward: reduce what is left when backward ends
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._queued = True
            b.arrived.add(p)
            if len(b.arrived) == len(b.params):
                self._reduce_scatter(b)

    def _reduce_scatter(self, b):
        """Stage 2: sum the bucket over ranks into my shard, then free the full gradient."""
        if b.grad is None:  # no gradient here this backward; other ranks' sums still need my zeros
            b.grad = torch.zeros_like(b.flat)
        self._note_live()
        out = torch.empty(b.shard, dtype=b.flat.dtype, device=b.flat.device)
        comm.reduce_scatter(out, b.grad, group=self.group)
        out.div_(self.n)
        b.shard_grad = out if b.shard_grad is None else b.shard_grad.add_(out)
        b.grad, b.reduced = None, True
        self._note_freed(b)

    def _live_grad_bytes(self):
        """Bytes of full-gradient storages still alive, measured, not read off ``b.grad``: every
        buffer seen as a bucket's ``grad`` is watched by a weak reference to its storage, which dies
        only when its last reference goes (as `labs.measure.memory.PeakMemory` counts), so a buffer
        dropped from ``b.grad`` but kept anywhere else still counts."""
        watched = {k: v for k, v in self._grad_storages.items() if v[0]() is not None}
        for b in self.buckets:
            if b.grad is not None:
                s = b.grad.untyped_storage()
                watched.setdefault(s._cdata, (weakref.ref(s), s.nbytes()))
        self._grad_storages = watched
        return sum(n for _, n in watched.values())

    def _note_live(self):
        """The full-gradient bytes live as a bucket is reduced (all of them, at stages 0-1)."""
        self.full_grad_peak_bytes = max(self.full_grad_peak_bytes, self._live_grad_bytes())

    def _note_freed(self, b):
        """Stage 2, right after bucket ``b``'s reduction returns: the full-gradient bytes still alive
        (measured, `_live_grad_bytes`) beside those of the buckets still filling (some but not all of
        their gradients arrived, not reduced: from the arrivals and the bucket sizes). Equal when
        every bucket reduced so far was freed."""
        filling = sum(x.flat.nbytes for x in self.buckets
                      if x.arrived and len(x.arrived) < len(x.params) and not x.reduced)
        self.reductions.append({"bucket": self.buckets.index(b), "live_after": self._live_grad_bytes(),
                                "filling": filling})

    def _end_of_backward(self):
        for b in self.buckets:  # the same order on every rank
            if not b.reduced:
                self._reduce_scatter(b)
            b.arrived, b.reduced = set(), False
        self._queued = False

    # -- the optimizer step -----------------------------------------------------------------
    @torch.no_grad()
    def reduce_grads(self):
        """The averaged gradient of this rank's shard, one tensor per bucket, in the master dtype.

        Stages 0-1 reduce here (once per optimizer step); stage 2 already did during backward.
        """
        if self._reduced is None:
            self._reduced = [self._reduce_bucket(b).to(b.master.dtype) for b in self.buckets]
        return self._reduced

    def _reduce_bucket(self, b):
        if self.stage == 2:
            return b.shard_grad if b.shard_grad is not None else torch.zeros_like(b.mine())
        full = b.grad if b.grad is not None else torch.zeros_like(b.flat)
        b.grad = full
        self._note_live()
        if self.stage == 0 or self.zero1_allreduce:
            comm.all_reduce(full, group=self.group)
            return full.div_(self.n)[b.lo:b.lo + b.shard]
        mine = torch.empty(b.shard, dtype=full.dtype, device=full.device)
        comm.reduce_scatter(mine, full, group=self.group)
        return mine.div_(self.n)

    @torch.no_grad()
    def step(self):
        for b, grad in zip(self.buckets, self.reduce_grads()):
            for p, piece, first, last in b.pieces:
                piece.grad = grad[first:last] if p in self.got_grad else None
        self.optimizer.step()
        for b in self.buckets:
            for _, piece, _, _ in b.pieces:
                piece.grad = None
            if b.master.data_ptr() != b.mine().data_ptr():
                b.mine().copy_(b.master)          # round the new master shard into the weights
            if self.stage >= 1:                   # every rank's updated shard, back to everyone
                comm.all_gather(b.flat, b.mine(), group=self.group)
        self._reduced = None

    def zero_grad(self, set_to_none=True):
        """Stages 0-1 zero their gradient buckets (kept, as DDP's are); stage 2 drops its shard."""
        for b in self.buckets:
            if b.grad is not None and self.stage <= 1:
                b.grad.zero_()
            if b.shard_grad is not None:
                b.shard_grad = None if set_to_none else b.shard_grad.zero_()
        self.got_grad.clear()
        self._reduced, self.reductions = None, []

    # -- what it holds ----------------------------------------------------------------------
    def state_tensors(self):
        """Every tensor this optimizer holds besides the parameters: gradients, masters, state."""
        out = self.gradient_tensors() + [b.master for b in self.buckets]
        return out + [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]

    def gradient_tensors(self):
        return [t for b in self.buckets for t in (b.grad, b.shard_grad) if t is not None]

    @torch.no_grad()
    def full_masters(self):
        """{parameter: its full master weights}, all-gathered (for checks; not counted as traffic)."""
        out = {}
        for b in self.buckets:
            flat = b.master.new_empty(b.padded)
            if self.stage == 0:
                flat.copy_(b.master)
            else:
                comm.all_gather_single(flat, b.master.contiguous(), group=self.group)
            for p in b.params:
                out[p] = flat[b.start[p]:b.start[p] + p.numel()].view(p.shape).clone()
        return out
