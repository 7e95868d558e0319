"""Chapter 2: data parallelism built by hand, a drop-in for torch's DistributedDataParallel.

Every rank holds the whole model and its own slice of the batch. After backward the gradients
are averaged with one all-reduce, so every replica takes the same step (Li et al. 2020, "PyTorch
Distributed", arXiv 2006.15704). Two refinements make it fast:
- buckets: gradients are packed into a few flat buffers, one all-reduce each, since many small
  messages pay the latency term alpha many times;
- overlap: backward produces the last layers' gradients first, so a bucket whose gradients are
  all ready starts its all-reduce while backward is still computing the earlier layers.
`no_sync` skips the all-reduce for the micro-batches of gradient accumulation. The lab that
measures it against torch's DDP and one process is `labs.data_parallel.ddp`.
"""
import contextlib
import time

import torch
import torch.distributed as dist

from labs.measure import comm


class Bucket:
    """Gradients of one dtype packed into one flat buffer: one all-reduce instead of many."""

    def __init__(self, params):
        self.params = params  # all of one dtype: a bucket never changes a gradient's precision
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.ready, self.work, self.times = 0, None, {}
        self.running = False  # was its all-reduce still running when its launch handed control back?


class HandDDP:
    """Bucketed, overlapped gradient all-reduce through hooks, with torch DDP's semantics.

    As in torch DDP (Li et al. 2020, section 3.2): buckets by dtype in reverse parameter order,
    launched in bucket order (every rank must issue the same all-reduces in the same order);
    gradients divided by N before the sum (no overflow in low precision); when backward ends the
    averages are in ``.grad``, so a second backward before the optimizer step adds to them and
    is reduced in turn (both count); frozen parameters are left out; a parameter that gets no
    gradient on this rank in a step is reduced as zeros (torch needs find_unused_parameters=True
    for that). One difference: a parameter no rank used ends with a zero gradient where torch
    leaves None, which is the same for SGD without momentum or weight decay.
    ``overlap=False`` launches every all-reduce only after autograd has finished.
    Two named mistakes the chapter's overlap check must catch, both with overlap on:
    ``wait_in_hook=True`` launches each bucket from its hook and waits for it there, so nothing runs
    while backward computes; ``defer_launch=True`` launches nothing until every bucket is full, then
    all of them from the last gradient's hook, so no all-reduce starts while backward has work left.
    `finish()` returns the step's per-bucket timeline.
    """

    def __init__(self, model, bucket_cap_bytes=25 * 2**20, overlap=True, wait_in_hook=False,
                 defer_launch=False):
        if bucket_cap_bytes < 1:
            raise ValueError(f"bucket_cap_bytes must be at least 1, got {bucket_cap_bytes}.")
        self.model, self.overlap, self.sync, self.wait_in_hook = model, overlap, True, wait_in_hook
        self.defer_launch = defer_launch
        self.world_size = dist.get_world_size()
        with torch.no_grad():  # replicas must start equal: everyone takes rank 0's weights
            for p in model.parameters():
                comm.broadcast(p.data, src=0)
        self.buckets = self._make_buckets([p for p in model.parameters() if p.requires_grad],
                                          bucket_cap_bytes)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next, self.in_backward, self.synced, self.backward_end = 0, False, False, None
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    @staticmethod
    def _make_buckets(params, cap):
        """One open bucket per dtype, filled in reverse registration order (backward's order)."""
        buckets, open_ = [], {}
        for p in reversed(params):
            current = open_.setdefault(p.dtype, [])
            current.append(p)
            if sum(q.numel() * q.element_size() for q in current) >= cap:
                buckets.append(Bucket(open_.pop(p.dtype)))
        return buckets + [Bucket(current) for current in open_.values()]

    def __call__(self, *args, **kwargs):  # like torch DDP, the wrapper runs the model's forward
        return self.model(*args, **kwargs)

    def _grad_ready(self, p):
        if not self.sync:
            return  # no_sync: let .grad accumulate locally
        if not self.in_backward:  # the first gradient of this backward: settle up when autograd ends
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        b = self.bucket_of[p]
        b.ready += 1
        if b.ready == len(b.params):
            b.times["ready"] = time.perf_counter()
        if self.defer_launch and any(x.ready < len(x.params) for x in self.buckets):
            return  # the named mistake: hold every launch until the last bucket is full
        while self.overlap and self.next < len(self.buckets) and \
                self.buckets[self.next].ready == len(self.buckets[self.next].params):
            self._launch(self.buckets[self.next])

    def _end_of_backward(self):
        self.backward_end = time.perf_counter()  # autograd's last gradient is computed
        self._settle()
        self.in_backward = False

    def _settle(self):
        """Launch what is left, in order (no gradient: zeros), wait, and put the averages in ``.grad``."""
        for b in self.buckets[self.next:]:
            for p in b.params:
                if p.grad is None:  # unused in this step on this rank
                    p.grad = torch.zeros_like(p)
            b.times.setdefault("ready", time.perf_counter())
            self._launch(b)
        for b in self.buckets:
            b.work.wait()
            offset = 0
            for p in b.params:
                p.grad.copy_(b.buffer[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            b.ready, b.work = 0, None
        self.next, self.synced = 0, True

    def _launch(self, b):
        b.times["start"] = time.perf_counter()
        torch.cat([p.grad.view(-1) for p in b.params], out=b.buffer)
        b.buffer.div_(self.world_size)
        b.work = comm.all_reduce(b.buffer, async_op=True)
        # "done" is when this callback ran, no earlier than the all-reduce finished: the callback
        # needs the GIL, so the stamp is an upper bound on the end, not the true end.
        b.work.get_future().then(lambda fut, b=b: b.times.__setitem__("done", time.perf_counter()))
        self.next += 1
        if self.wait_in_hook and self.in_backward:
            b.work.wait()  # the named mistake: backward resumes only once this all-reduce is done
        # exact, not a stamp: is_completed() reads the work's state, no callback or GIL involved
        b.running = not b.work.is_completed()

    def finish(self):
        """The step's per-bucket timeline; syncs now if no synced backward reached the hooks."""
        if not self.synced:
            self._settle()
        timeline = [dict(b.times, bytes=b.buffer.numel() * b.buffer.element_size(), running=b.running)
                    for b in self.buckets]
        for b in self.buckets:
            b.times, b.running = {}, False
        self.synced = False
        return timeline

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


def exposed_comm(timeline, backward_end):
    """Seconds from the end of backward to the end of the last all-reduce: what overlap could not hide."""
    return max(0.0, max(t["done"] for t in timeline) - backward_end)
