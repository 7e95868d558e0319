"""Chapter 10: beside each hand collective, what gloo's own implementation puts on the wire.

Three byte kinds, kept apart (DESIGN.md, "Measured means measured"), per rank:

- **counted**: the hand collective of `labs.collectives.algorithms`, each message counted as it is sent;
- **wire**: the library's collective on the same input, the increase of ``wchar`` in
  /proc/self/io across it (`labs.measure.wire.measure`; gloo on Linux only, else None and the reason);
- **formula**: Thakur, Rabenseifner & Gropp (2005) for the hand algorithm.

The wire is checked against a model of the algorithm gloo runs, read from its source
(facebookincubator/gloo) as torch's ProcessGroupGloo calls it:

    broadcast       binomial tree (gloo/broadcast.cc)             `wire.gloo_broadcast`
    reduce          ring reduce-scatter in segments, then every rank sends its chunk
                    to the root (gloo/reduce.cc)                  `gloo_reduce`
    all_gather      ring, each shard in two halves (gloo/allgather.cc)   `wire.gloo_all_gather`
    all_reduce      ring reduce-scatter + all-gather in segments (gloo/allreduce.cc)
    reduce_scatter  the same full all-reduce, one slice kept (torch's ProcessGroupGloo)
    all_to_all      pairwise: rank r sends block r+i to rank r+i, i = 1..p-1 (gloo/alltoall.cc)

Every gloo message costs its sender two 48-byte preambles and its receiver one (`wire.gloo_messages`).
"""
import torch

from labs.collectives import algorithms, toolkit as col
from labs.collectives.recursive import Rounds
from labs.measure import comm, wire
from labs.launcher import launch

ALGORITHM = {"broadcast": "binomial tree", "reduce": "ring reduce-scatter, then gather to the root",
             "all_gather": "ring (shards in two halves)", "all_reduce": "ring, segmented",
             "reduce_scatter": "a full ring all-reduce, one slice kept", "all_to_all": "pairwise exchange"}
HAND = {"broadcast": "tree", "reduce": "tree", "all_gather": "ring", "all_reduce": "ring",
        "reduce_scatter": "ring", "all_to_all": "pairwise"}


def _ceil(a, b):
    return -(-a // b)


def gloo_reduce(nbytes, p, rank, root=0, element_size=4, max_segment=1 << 20):
    """Bytes ``rank`` writes in gloo's reduce (gloo/reduce.cc): the segment arithmetic of the source.

    segmentBytes = roundUp(min(ceil(S / 2p), maxSegment), e); numSegments = roundUp(max(ceil(S /
    segmentBytes), 2p), p), k = numSegments / p per rank. Iterations i < numSegments - 2 each send
    to rank-1 and receive from rank+1 the segment at an offset that may fall past S (then nothing
    moves); a non-root rank then sends its chunk of k segments to the root, which receives them.
    """
    seg_max = element_size * (max_segment // element_size)
    seg = _ceil(min(_ceil(nbytes, 2 * p), seg_max), element_size) * element_size
    segments = _ceil(max(_ceil(nbytes, seg), 2 * p), p) * p
    k = segments // p
    payload = sent = received = 0
    for i in range(segments - 2):
        send_off = (((rank + 1) * k + i) * seg) % (segments * seg)
        recv_off = (((rank + 2) * k + i) * seg) % (segments * seg)
        length = min(seg, nbytes - send_off)
        payload, sent = payload + max(length, 0), sent + (length > 0)
        received += min(seg, nbytes - recv_off) > 0
    if rank == root:
        received += sum(nbytes - j * k * seg > 0 for j in range(p) if j != rank)
    elif nbytes - rank * k * seg > 0:
        payload, sent = payload + min(k * seg, nbytes - rank * k * seg), sent + 1
    return wire.gloo_messages(payload, sent, received)


def gloo_all_to_all(nbytes, p):
    """Bytes one rank writes in gloo's pairwise all-to-all of an ``nbytes`` input: p-1 blocks out, p-1 in."""
    return wire.gloo_messages((p - 1) * nbytes // p, p - 1, p - 1)


def gloo_model(op, nbytes, p, rank):
    """This rank's wire bytes for the library's ``op`` on a buffer of ``nbytes`` (col's convention:
    the full buffer), from gloo's source; the all-reduce ring is symmetric, so 1/p of all ranks'."""
    if op == "broadcast":
        return wire.gloo_broadcast(nbytes, p, rank)
    if op == "reduce":
        return gloo_reduce(nbytes, p, rank)
    if op == "all_gather":
        return wire.gloo_all_gather(nbytes, p)
    if op == "all_to_all":
        return gloo_all_to_all(nbytes, p)
    return wire.gloo_allreduce_all_ranks(nbytes, p) // p    # all_reduce, and reduce_scatter inside it


@launch.on_cpu("gloo's wire bytes, read from /proc/self/io, which NCCL's traffic never passes through")
def rank_beside(rank, world_size, numel):
    """One rank, per op: its counted bytes in the hand collective and its wire bytes in gloo's.

    The full buffer's size is read from the tensors used (the all-gather's output, else the input)."""
    out = {}
    for op in algorithms.OPS:
        x, buf = col._inputs(op, numel, world_size, rank)
        nbytes = (buf if op == "all_gather" else x).numel() * x.element_size()
        with comm.counting() as tally:
            hand = x.clone()
            algorithms.HAND[op, HAND[op]](hand, Rounds()) if buf is None else \
                algorithms.HAND[op, HAND[op]](torch.empty_like(buf), hand, Rounds())
        col._library(op, x, buf)   # warm-up: gloo's first call on a pair sets up its connection
        with wire.measure() as w:   # the library's collective alone (a clone adds no wire bytes)
            col._library(op, x, buf)
        out[op] = {"nbytes": nbytes, "counted": tally.bytes_sent, "wire": w.bytes, "reason": w.reason}
    return out


def beside(world_size, numel, timeout=120.0):
    """Per op: algorithm (gloo's and the hand one), nbytes, and per rank the counted bytes, the
    measured wire bytes, gloo's model of them, and the formula (TRG 2005, the most one rank sends)."""
    ranks = launch.spawn(rank_beside, world_size, numel, timeout=timeout)
    rows = {}
    for op in algorithms.OPS:
        n = ranks[0][op]["nbytes"]
        rows[op] = {"gloo_algorithm": ALGORITHM[op], "hand_algorithm": HAND[op], "nbytes": n,
                    "counted": [r[op]["counted"] for r in ranks], "wire": [r[op]["wire"] for r in ranks],
                    "wire_reason": ranks[0][op]["reason"],
                    "wire_model": [gloo_model(op, n, world_size, i) for i in range(world_size)],
                    "formula_max": col.formula(op, HAND[op], world_size, n)[1]}
    return rows


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Per collective: counted hand bytes, gloo's wire bytes (and its source's model), formula.")
    p.add_argument("--numel", type=cli.positive_int, default=840, help="elements of the full buffer")
    args = cli.parse(p, argv)
    for op in algorithms.OPS:   # the hand collectives' block sizes, refused before any rank starts
        col.check(op, HAND[op], args.world_size, args.numel)
    rows = beside(args.world_size, args.numel, timeout=args.timeout)
    lines = [f"{'collective':15s} {'counted (max)':>13s} {'wire (max)':>11s} {'model (max)':>11s} "
             f"{'formula':>8s}"]
    for op, r in rows.items():
        wire_max = "n/a" if None in r["wire"] else max(r["wire"])
        lines.append(f"{op:15s} {max(r['counted']):>13} {wire_max:>11} {max(r['wire_model']):>11} "
                     f"{r['formula_max']:>8}")
    cli.report({"world_size": args.world_size, "numel": args.numel, "rows": rows}, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
