"""Chapter 3's spawned test workers: a ZeRO-2 with a plausible bug, to show the peak checks catch it."""
import torch

from labs.measure import comm
from labs.zero import stages
from labs.zero.sharded_optimizer import ShardedOptimizer


@torch.no_grad()
def _grad_ready_at_end(self, p):
    """The bug: stage 2 adds each gradient into its bucket but reduce-scatters nothing from the hook;
    every bucket waits for the end of backward, so the whole gradient is live at once, as in ZeRO-1."""
    b = self.bucket_of[p]
    if b.grad is None:
        b.grad = torch.zeros_like(b.flat)
    b.grad[b.start[p]:b.start[p] + p.numel()].add_(p.grad.reshape(-1))
    p.grad = None
    self.got_grad.add(p)
    if self.stage == 2 and not self._queued:
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._queued = True


def _reduce_scatter_keeping_block0(self, b):
    """The bug: the bucket of block 0 (the second one backward completes) is reduce-scattered but its
    full gradient is left live until backward ends (`_end_of_backward_freeing`), an off-by-one on
    the last block. It trains exactly, and its full-gradient count at each reduction stays below the
    whole gradient: the rest bucket is live through all of backward either way."""
    if b.grad is None:
        b.grad = torch.zeros_like(b.flat)
    self._note_live()
    out = torch.empty(b.shard, dtype=b.flat.dtype, device=b.flat.device)
    comm.reduce_scatter(out, b.grad, group=self.group)
    out.div_(self.n)
    b.shard_grad = out if b.shard_grad is None else b.shard_grad.add_(out)
    if self.buckets.index(b) != 1:
        b.grad = None
    b.reduced = True
    self._note_freed(b)


_STASH = []  # the stash bug's full buckets, off the optimizer's books


def _reduce_scatter_stashing(self, b):
    """The bug: every bucket is reduce-scattered and ``b.grad`` set to None as it should, but the full
    gradient is also kept in a list until backward ends (`_end_of_backward_clearing`). The bucket
    attributes read as freed; only the storage stays alive."""
    g = b.grad
    _GOOD["reduce_scatter"](self, b)
    _STASH.append(g)


def _end_of_backward_clearing(self):
    """`ShardedOptimizer._end_of_backward`, then the stash is emptied."""
    _GOOD["end"](self)
    _STASH.clear()


def _end_of_backward_freeing(self):
    """`ShardedOptimizer._end_of_backward`, then every full gradient still live is freed."""
    _GOOD["end"](self)
    for b in self.buckets:
        b.grad = None


_GOOD = {"end": ShardedOptimizer._end_of_backward,
         "reduce_scatter": ShardedOptimizer._reduce_scatter}


def _patched(obj, name, fn, call):
    good = getattr(obj, name)
    setattr(obj, name, fn)
    try:
        return call()
    finally:
        setattr(obj, name, good)


def zero2_bugs(rank, world_size, steps=2, batch_size=1):
    """`stages.run` for stage 2 with `_grad_ready_at_end` ("at_end": every bucket waits for the end
    of backward), with `_reduce_scatter_keeping_block0` ("keeps_block0") and with
    `_reduce_scatter_stashing` ("stashes")."""
    run = lambda: stages.run(rank, world_size, 2, steps, batch_size)  # noqa: E731

    def keeps_block0():
        bug = _reduce_scatter_keeping_block0
        return _patched(ShardedOptimizer, "_end_of_backward", _end_of_backward_freeing,
                        lambda: _patched(ShardedOptimizer, "_reduce_scatter", bug, run))

    def stashes():
        bug = _reduce_scatter_stashing
        return _patched(ShardedOptimizer, "_end_of_backward", _end_of_backward_clearing,
                        lambda: _patched(ShardedOptimizer, "_reduce_scatter", bug, run))

    return {"at_end": _patched(ShardedOptimizer, "_grad_ready", _grad_ready_at_end, run),
            "keeps_block0": keeps_block0(), "stashes": stashes()}


def scaled_lr(rank, world_size, scales=(1.1, 2.0), steps=2, batch_size=1):
    """`stages.run` for DDP (stage 0) and ZeRO-1 with the sharded optimizer's learning rate scaled by
    each of ``scales`` while one process keeps the true one: a wrongly scaled step, shared by both
    stages, so they still agree with each other bit for bit. {scale: {stage: result}}."""
    good = ShardedOptimizer.__init__

    def init(self, *args, lr, **kwargs):
        good(self, *args, lr=scale * lr, **kwargs)

    def both():
        return {str(s): stages.run(rank, world_size, s, steps, batch_size) for s in (0, 1)}

    out = {}
    for scale in scales:
        out[scale] = _patched(ShardedOptimizer, "__init__", init, both)
    return out


@torch.no_grad()
def _step_without_copy(self):
    """The bug: the inner optimizer steps the fp32 master shard, but the new master is never rounded
    back into the bf16 weights (``b.mine().copy_(b.master)`` left out), so the weights never move."""
    for b, grad in zip(self.buckets, self.reduce_grads()):
        for p, piece, first, last in b.pieces:
            piece.grad = grad[first:last] if p in self.got_grad else None
    self.optimizer.step()
    for b in self.buckets:
        for _, piece, _, _ in b.pieces:
            piece.grad = None
        if self.stage >= 1:
            comm.all_gather(b.flat, b.mine(), group=self.group)
    self._reduced = None


def never_copies_master(rank, world_size, steps=2, batch_size=1):
    """`stages.run` for DDP (stage 0) and ZeRO-1 with `_step_without_copy` as their step: the bug is
    shared, so the two still agree with each other bit for bit."""
    good = ShardedOptimizer.step
    ShardedOptimizer.step = _step_without_copy
    try:
        return {str(s): stages.run(rank, world_size, s, steps, batch_size) for s in (0, 1)}
    finally:
        ShardedOptimizer.step = good


def plausible_bugs(rank, world_size):
    """`zero2_bugs` and `scaled_lr` in one job (one spawn for the tests that refuse them)."""
    return {**zero2_bugs(rank, world_size), "scaled_lr": scaled_lr(rank, world_size)}
