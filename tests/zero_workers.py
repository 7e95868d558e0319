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


def zero2_reduces_at_end(rank, world_size, steps=2, batch_size=1):
    """`stages.run` for stage 2 with `_grad_ready_at_end` in place of the hook's reduce-scatter."""
    good = ShardedOptimizer._grad_ready
    ShardedOptimizer._grad_ready = _grad_ready_at_end
    try:
        return stages.run(rank, world_size, 2, steps, batch_size)
    finally:
        ShardedOptimizer._grad_ready = good



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
