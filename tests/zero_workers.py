"""Chapter 3's spawned test workers: a ZeRO-2 with a plausible bug, to show the peak checks catch it."""
import torch

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

