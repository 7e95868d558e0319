"""The library's wire bytes: what a process really hands to its sockets (chapter 2, and every lab).

`labs.measure.comm` keeps three kinds of byte counts apart: counted messages, formula bytes, and the
library's wire bytes. This module measures the third kind and models it from the library's source.

- **Measured** (`measure`): on Linux with gloo, the increase of ``wchar`` in /proc/self/io across a
  block, the bytes this process passed to ``write``/``writev``, which is how gloo's TCP transport
  sends. Where it cannot be read (NCCL moves data without the process's write calls; no
  /proc/self/io) the result is None with a one-sentence reason, never a guess.
- **Modelled from gloo's source** (`gloo_*`): every gloo operation starts with a 48-byte preamble
  (six size_t: nbytes, opcode, slot, offset, length, roffset; gloo/transport/tcp/pair.h). A data
  message costs its sender two (NOTIFY_SEND_READY, then the data's own) and its receiver one
  (NOTIFY_RECV_READY). The models below say what gloo's algorithms send; a lab checks the
  measurement against them, so a window that caught anything else (a barrier, a print, a file
  write) or a different algorithm shows up as a difference.

    with wire.measure() as w:
        dist.all_reduce(x)
    w.bytes      # or None, and w.reason
"""
import contextlib

import torch.distributed as dist

PREAMBLE = 48  # bytes: six size_t at the head of every gloo operation


def wchar():
    """Bytes this process has written so far (``wchar`` in /proc/self/io: sockets, files, pipes)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise OSError("/proc/self/io has no wchar line")


def unavailable(group=None):
    """None if this process's wire bytes can be read, else a one-sentence reason why not."""
    backend = dist.get_backend(group)
    if backend != "gloo":
        return (f"the {backend} backend moves data without the process's write calls (GPU copies, "
                "network verbs), so /proc/self/io cannot see it; only formula bytes are available")
    try:
        wchar()
    except OSError as e:
        return f"/proc/self/io cannot be read here ({e}): not Linux, or a restricted /proc"
    return None


class Wire:
    """What `measure` found: ``bytes`` written in the window, or None and the ``reason``."""

    def __init__(self, reason):
        self.bytes, self.reason = None, reason

    def as_dict(self):
        return {"bytes": self.bytes, "reason": self.reason}


@contextlib.contextmanager
def measure(group=None):
    """Bytes this process wrote to its sockets inside the block (gloo on Linux), else None + reason.

    The window is tight: a barrier first, so every rank has finished the barrier's own messages
    before the start value is read, and the end value is read as soon as the block returns. The
    block must finish its communication (synchronous calls, or ``wait()``) and write nothing else
    (no prints, no warnings, no files): wchar counts every write of the process, all threads.
    gloo's source also has a shared-memory all-reduce for ranks on one node (chosen when
    LOCAL_WORLD_SIZE equals the group size); the torch 2.13 CPU build used here does not take it
    (checked with LOCAL_WORLD_SIZE set), but a build that did would show (close to) zero here.
    """
    wire = Wire(unavailable(group))
    if wire.reason is None:
        dist.barrier(group=group)
        start = wchar()
    yield wire
    if wire.reason is None:
        wire.bytes = wchar() - start


# ---- gloo's traffic, from its source ----------------------------------------------------------

def gloo_messages(payload, sent, received):
    """Wire bytes of point-to-point traffic: the payload plus three preambles per message."""
    return payload + PREAMBLE * (2 * sent + received)


def gloo_allreduce_all_ranks(nbytes, n, element_size=4, max_segment=1 << 20):
    """Bytes all ranks together write for one gloo ring all-reduce of ``nbytes`` (gloo/allreduce.cc, `ring`).

    gloo cuts the buffer into a multiple of n segments, at least 2n, at most 1 MiB each; each
    non-empty segment travels n-1 hops in reduce-scatter and n-1 in all-gather. gloo's
    reduce-scatter runs this same all-reduce and keeps one slice.
    """
    seg_max = element_size * max(1, max_segment // element_size)
    segments = -(-max(-(-nbytes // seg_max), 2 * n) // n) * n
    seg_bytes = -(-(-(-nbytes // segments)) // element_size) * element_size
    messages = 2 * (n - 1) * -(-nbytes // seg_bytes)
    return gloo_messages(2 * (n - 1) * nbytes, messages, messages)


def gloo_all_gather(nbytes, n):
    """Bytes one rank writes for gloo's ring all-gather of ``nbytes`` in all (gloo/allgather.cc).

    N-1 steps, each passing one rank's shard of nbytes/N to the right in two halves.
    """
    return gloo_messages((n - 1) * nbytes // n, 2 * (n - 1), 2 * (n - 1))


def gloo_broadcast_messages(n, rank, root=0):
    """(sent, received) messages of gloo's binomial-tree broadcast for ``rank`` (gloo/broadcast.cc)."""
    v, dim = (rank - root) % n, (n - 1).bit_length()
    mask, sent, received = (1 << dim) - 1, 0, 0
    for i in range(dim):
        mask ^= 1 << i
        if v & mask or (v ^ (1 << i)) >= n:
            continue
        if v & (1 << i):
            received += 1
        else:
            sent += 1
    return sent, received


def gloo_broadcast(nbytes, n, rank, root=0):
    """Bytes ``rank`` writes in gloo's broadcast of ``nbytes``: M to each child, a preamble to its parent."""
    sent, received = gloo_broadcast_messages(n, rank, root)
    return gloo_messages(sent * nbytes, sent, received)
