"""Chapter 2: algorithm and bus bandwidth, the nccl-tests way, for the library's all-reduce.

nccl-tests (NVIDIA, doc/PERFORMANCE.md) reports two bandwidths for a collective on N ranks that
takes t seconds on S bytes (S = the size of the full buffer: the all-reduce's input, the
all-gather's output, the reduce-scatter's input):

    algbw = S / t                      what an application sees
    busbw = algbw * factor(N)          comparable with the link's peak, whatever N is
    factor: all-reduce 2(N-1)/N, all-gather and reduce-scatter (N-1)/N, broadcast 1

The factor is what an optimal algorithm (the ring) moves through each rank's link per byte of S.
Here it is also measured: the library's wire bytes of one rank (`labs.measure.wire`, gloo on Linux) for
the same all-reduce, divided by S. For gloo's ring all-reduce that is 2(N-1)/N plus gloo's
48-byte preambles, which `wire.gloo_allreduce_all_ranks` models from gloo's source; where the
wire cannot be read (NCCL) the measured factor is None with the reason, and busbw stays a formula.

    python -m labs.data_parallel.bus_bandwidth --world-size 4
"""
import statistics

import torch
import torch.distributed as dist

from labs.launcher import launch, preflight
from labs.formulas import costs
from labs.measure import timing, wire

# the ops doc/PERFORMANCE.md defines
DOCUMENTED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
KiB, MiB = 1024, 1024 ** 2
SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB]


def bus_factor(op, world_size):
    """nccl-tests' busbw / algbw for ``op`` on ``world_size`` ranks (doc/PERFORMANCE.md)."""
    if op not in DOCUMENTED:
        raise ValueError(f"unknown collective {op!r}; use one of {', '.join(DOCUMENTED)}.")
    preflight.check_world_size(world_size)
    return float(costs.factor(op, world_size)) if world_size > 1 else float(op == "broadcast")


def bandwidths(nbytes, seconds, world_size, op="all_reduce"):
    """algbw = S / t and busbw = algbw * factor, in bytes per second."""
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}; time at least one call.")
    algbw = nbytes / seconds
    return {"algbw": algbw, "busbw": algbw * bus_factor(op, world_size)}


def preamble_bytes_all_ranks(nbytes, world_size, element_size=4):
    """Bytes gloo's ring all-reduce writes beyond the ring's payload 2(N-1)S, all ranks together."""
    return wire.gloo_allreduce_all_ranks(nbytes, world_size, element_size) - 2 * (world_size - 1) * nbytes


def rank_sweep(rank, world_size, sizes=SIZES, repeats=5):
    """One rank: per size, its wire bytes for one all-reduce and the median seconds of ``repeats``.

    The buffer is fp32 and its size S is read from the tensor handed to the all-reduce. The wire
    window holds exactly one call (between barriers, nothing else written); the timed calls start
    after a barrier each, after one untimed warm-up (connections, allocations).
    """
    out = []
    for size in sizes:
        if size < 4 or size % 4:
            raise ValueError(f"every size must be a positive multiple of 4 bytes (fp32), got {size}.")
        buf = torch.ones(size // 4, device=launch.device())
        nbytes = buf.numel() * buf.element_size()
        dist.all_reduce(buf)  # warm-up
        with wire.measure() as w:
            dist.all_reduce(buf)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = timing.now()
            dist.all_reduce(buf)
            times.append(timing.now() - start)
        out.append({"nbytes": nbytes, "wire_bytes": w.bytes, "wire_reason": w.reason,
                    "seconds": statistics.median(times)})
    return out


def sweep(world_size, sizes=SIZES, repeats=5, timeout=300.0, backend=None):
    """algbw, busbw and the measured wire factor per size, on ``world_size`` ranks (``backend``: the
    launcher's choice unless given; chapter 2 pins gloo, whose wire it reads).

    Per size: nbytes (S), seconds (the slowest rank's median: a collective ends when its last rank
    does, as nccl-tests reports), algbw and busbw (bytes/s), factor (2(N-1)/N), wire_bytes (per
    rank, or None with wire_reason), wire_factor (max over ranks of wire bytes / S),
    preamble_factor (gloo's preambles per rank / S, from its source: the expected excess of
    wire_factor over factor) and wire_all_ranks_model (what all ranks together should write).
    """
    return summarize(launch.spawn(rank_sweep, world_size, list(sizes), repeats, timeout=timeout,
                                  backend=backend))


def summarize(ranks):
    """`sweep`'s result from every rank's `rank_sweep` list (rank order)."""
    world_size, rows = len(ranks), []
    for i in range(len(ranks[0])):
        per_rank = [r[i] for r in ranks]
        nbytes, seconds = per_rank[0]["nbytes"], max(r["seconds"] for r in per_rank)
        wires = [r["wire_bytes"] for r in per_rank]
        known = None not in wires
        rows.append({"nbytes": nbytes, "seconds": seconds, **bandwidths(nbytes, seconds, world_size),
                     "factor": bus_factor("all_reduce", world_size), "wire_bytes": wires,
                     "wire_reason": per_rank[0]["wire_reason"],
                     "wire_factor": max(wires) / nbytes if known else None,
                     "wire_all_ranks": sum(wires) if known else None,
                     "wire_all_ranks_model": wire.gloo_allreduce_all_ranks(nbytes, world_size),
                     "preamble_factor": preamble_bytes_all_ranks(nbytes, world_size) / world_size / nbytes})
    return {"world_size": world_size, "backend": preflight.choose_backend(world_size), "rows": rows}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("All-reduce algbw and busbw (nccl-tests' definitions), with the measured wire factor.")
    p.add_argument("--repeats", type=cli.positive_int, default=5)
    args = cli.parse(p, argv)
    ranks = launch.launch(rank_sweep, args.world_size, SIZES, args.repeats, timeout=args.timeout)
    if ranks is None:
        return
    result = summarize(ranks)
    lines = [f"{'size':>10} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11} {'factor':>7} {'wire/S':>7}"]
    for r in result["rows"]:
        wf = "n/a" if r["wire_factor"] is None else f"{r['wire_factor']:.4f}"
        lines.append(f"{r['nbytes']:>10} {r['seconds'] * 1e3:>9.3f} {r['algbw'] / 1e9:>11.3f} "
                     f"{r['busbw'] / 1e9:>11.3f} {r['factor']:>7.4f} {wf:>7}")
    cli.report(result, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
