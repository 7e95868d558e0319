"""Chapter 15: the collective matmul, the idea behind async tensor parallelism, by hand.

Under sequence parallelism the column-parallel layer first all-gathers its input along the sequence and
then multiplies (chapter 6's `sp_layers.ColumnParallelLinear`): Y_i = [X_0; ...; X_{t-1}] A_i^T (A_i:
rank i's weight shard, the book's W_i; t: the ranks, the book's N), the gather exposed before the matmul
can start. Split it into t ring steps instead (Wang et al. 2023, "Overlap communication with dependent
computation via decomposition in large deep learning models", ASPLOS; PyTorch's async tensor parallelism
does the same on GPU streams): at step k rank i holds the chunk X_c of rank c = i - k (mod t), posts the
send of X_c to rank i + 1 and the receive of X_{c-1} from rank i - 1, and multiplies Y_i[c] = X_c A_i^T
while it travels. Only the last chunk's matmul has nothing to hide behind it (the last step posts no
transfer); every transfer runs under a matmul. The control (``overlap=False``) is the same ring with
each transfer waited for before the matmul it could hide under: the same messages, chunks and matmuls,
only the overlap taken away. (Chapter 6's layer, a gloo ``all_gather`` with sequence-first transposes
and a matmul on a non-contiguous view, differs from the ring in more than the overlap, so it is not the
control.)

The result is the plain layer's, up to rounding: the plain layer multiplies all t chunks in one
matmul, the ring one chunk at a time, and a BLAS may sum the h products of an output element in a
different order for a different number of rows. `bound` is the derived limit: each result is
within gamma_{h+1} (|X| |A_i|^T + |b|) of the exact one (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., section 3.1: a dot product of n terms in floating point, in any
order, with gamma_n = n u / (1 - n u)), so the two differ by at most twice that, element by element.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labs.context_parallel import sp_layers
from labs.launcher import launch
from labs.measure import comm
from labs.tensor_parallel import megatron


def ring_gather_linear(x, weight, bias, group=None, overlap=True):
    """Y_i = AllGather_seq(x) A_i^T + b in t ring steps, each transfer under the chunk's matmul
    (``overlap=False``: each transfer waited for before that matmul). x (B, s/t, H) this rank's
    tokens; returns (B, s, out/t), the plain layer's layout."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(t))
    B, rows, _ = x.shape
    out = x.new_empty((B, t * rows, weight.size(0)))
    current = x.contiguous()
    for k in range(t):
        c = (i - k) % t                                   # whose chunk this rank holds at step k
        pending = []
        if k < t - 1:                                     # pass it on while multiplying it
            incoming = torch.empty_like(current)
            pending = [comm.isend(current, ranks[(i + 1) % t], group=group, tag=k),
                       comm.irecv(incoming, ranks[(i - 1) % t], group=group, tag=k)]
        if not overlap:                                   # the control: nothing under the transfer
            for req in pending:
                req.wait()
        out[:, c * rows:(c + 1) * rows] = F.linear(current, weight, bias)     # (B, s/t, out/t)
        if overlap:                                       # each request waited for once: a second
                                                          # wait on these gloo requests hangs
            for req in pending:
                req.wait()
        if k < t - 1:
            current = incoming
    return out


def layers(hidden, out_features, group=None, seed=0):
    """The plain layer (chapter 6's column-parallel layer behind its sequence all-gather) and its
    weight and bias: this rank's rows of one full ``nn.Linear(hidden, out_features)``."""
    t, i = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(seed)
    full = nn.Linear(hidden, out_features)
    rows = megatron.shard_rows(out_features, t, i)
    plain = sp_layers.ColumnParallelLinear(full, group, rows).to(launch.device())
    plain.regather = False        # forward only: keep the plain all-gather then matmul
    return plain


def bound(x_full, weight, bias):
    """Twice gamma_{h+1} (|X| |A|^T + |b|), elementwise, in float64: how far the ring's result may
    lie from the plain layer's when both are correctly rounded dot products of h + 1 terms."""
    u = torch.finfo(x_full.dtype).eps / 2
    n = x_full.size(-1) + 1
    gamma = n * u / (1 - n * u)
    mag = x_full.double().abs() @ weight.double().abs().t() + bias.double().abs()
    return 2 * gamma * mag


def check(rank, world_size, batch=2, seq=64, hidden=128, out_features=64, seed=0):
    """The ring equals the plain layer within `bound`, on this rank's output, and the ring without
    overlap bit for bit (the same matmuls on the same chunks); a misplaced chunk does not. Returns
    the largest error, the largest bound and how many elements match bit for bit."""
    plain = layers(hidden, out_features, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x_full = torch.randn(batch, seq, hidden, generator=g).to(launch.device())
    rows = seq // world_size
    x = x_full[:, rank * rows:(rank + 1) * rows]
    with torch.no_grad():
        want = plain(x)
        got = ring_gather_linear(x, plain.weight, plain.bias)
        control = ring_gather_linear(x, plain.weight, plain.bias, overlap=False)
    limit = bound(x_full, plain.weight, plain.bias)
    err = (got.double() - want.double()).abs()
    rolled = got.roll(rows, dims=1)                     # a ring that writes each chunk one slot off
    return {"max_abs_error": err.max().item(), "max_bound": limit.max().item(),
            "within_bound": bool((err <= limit).all()),
            "bitwise_equal_fraction": (got == want).float().mean().item(),
            "control_bitwise_equal": bool(torch.equal(got, control)),     # same matmuls, same order
            "misplaced_within_bound": bool(((rolled.double() - want.double()).abs() <= limit).all()),
            "shape": tuple(got.shape)}


def steps(rank, world_size, calls=4, batch=4, seq=256, hidden=1024, out_features=512, seed=0):
    """The two forward passes as profiled steps ("a": the ring with overlap, "b": the same ring,
    each transfer waited for before its matmul), ``calls`` layer calls each: a transfer of
    (s/t) x B x H floats against a matmul of the same rows."""
    plain = layers(hidden, out_features, seed=seed)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, seq // world_size, hidden, generator=gen).to(launch.device())

    def ring():
        with torch.no_grad():
            for _ in range(calls):
                ring_gather_linear(x, plain.weight, plain.bias)

    def waited():
        with torch.no_grad():
            for _ in range(calls):
                ring_gather_linear(x, plain.weight, plain.bias, overlap=False)
    return {"a": ring, "b": waited}
