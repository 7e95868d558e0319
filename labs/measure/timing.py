"""The host clock for timing work that may run on a GPU (every chapter that times something).

A CUDA kernel, and an NCCL collective, returns to Python as soon as it is queued: the host clock
read right after it times the launch, not the work. `now` is ``time.perf_counter`` read after this
process's queued GPU work is done, wherever this process has used CUDA, and the plain clock on a
CPU. It waits for the current stream: the computation this rank's Python issued, and every
collective it waited on (``work.wait()`` and a synchronous collective make the current stream wait
for NCCL's), but not a collective still in flight, so a lab can still time compute that overlaps
communication. Read it at both ends of a timed region: at the start, so work queued before the
region is not counted in it.

    start = timing.now()
    dist.all_reduce(x)
    seconds = timing.now() - start
"""
import time

import torch


def sync():
    """Wait for the work queued on this process's current CUDA stream; nothing on a CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def now():
    """``time.perf_counter()`` after this process's queued GPU work is done (see the module)."""
    sync()
    return time.perf_counter()
