"""Chapter 15: overlap shown in the trace and measured: exposed communication with and without it,
as a ratio within one run.

`interleaved` runs two variants of a step in alternating repeats under one profiler per rank
(`timing.order`), and `compare` reads each step's exposed communication from the traces
(`analysis`), averaged over the ranks, into paired ratios with an interval (`timing.ratio`).

- `ddp`: chapter 2's hand DDP, whose bucketed all-reduces start in backward as soon as a bucket is
  full (``overlap=True``) or all wait until autograd ends (``overlap=False``); one model, the
  switch flipped between steps.
- `fsdp2`: FSDP2 on one unit per block, each unit's all-gather issued one unit ahead (explicit
  prefetch, asynchronous unshard: `targets.prefetch_one_ahead`) or when the unit runs (FSDP2's
  default on the CPU, where no all-gather stream runs ahead); two copies of the model.
- the others live with their idea: `collective_matmul` (ring steps with each transfer under a
  matmul, against the same ring with each transfer waited for first), `moe_overlap` (two
  micro-batches' all-to-alls under each other's compute) and
  `input_pipeline` (prefetching loader workers, compared on the input stall instead).

`run` spawns the ranks once for several pairs.
"""
import os
import tempfile

import torch
import torch.distributed as dist

from labs import model as tiny
from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.data_parallel.hand_ddp import HandDDP
from labs.launcher import launch
from labs.profiling import analysis, collective_matmul, input_pipeline, moe_overlap, targets, timing, trace
from labs.zero.fsdp import fully_shard_units


def interleaved(rank, variants, folder, repeats, warmup=1, shapes=True):
    """Run {"a": step, "b": step} in ``repeats`` alternating pairs under one profiler; returns the
    variant of each recorded step, the trace read back and the wall-clock and kernel times.
    ``shapes``: record operator shapes (needed only to match point-to-point messages by peer and
    tag, the ring's; `trace.Recorder`)."""
    for _ in range(warmup):
        for step in variants.values():
            step()
    labels = []
    with trace.Recorder(folder, rank, memory=False, gz=False, shapes=shapes) as rec:
        for pair in timing.order(repeats):
            for name in pair:
                dist.barrier()
                with rec.step(len(labels)):
                    variants[name]()
                labels.append(name)
    dist.barrier()
    return {"labels": labels, "path": rec.path, "wall_s": rec.steps, "threads": rec.threads,
            "trace": trace.load(rec.path)}


def compare(results, names=("a", "b"), term="exposed_comm_s"):
    """Paired ratios a/b of a term of the step (exposed communication by default) and of step time.

    term: per step, the mean over ranks of that term of `analysis.breakdown`; step: the slowest
    rank's wall-clock step. Repeat i pairs the i-th step of "a" with the i-th of "b"."""
    per_rank = analysis.analyze([r["trace"] for r in results])
    labels = results[0]["labels"]
    values, wall = {"a": [], "b": []}, {"a": [], "b": []}
    for i, label in enumerate(labels):
        values[label].append(sum(rows[i][term] for rows in per_rank) / len(per_rank))
        wall[label].append(max(r["wall_s"][i] for r in results))
    return {"variants": dict(zip(("a", "b"), names)), "term": term, "values_s": values, "step_s": wall,
            "ratio": timing.ratio(values["a"], values["b"]), "step_ratio": timing.ratio(wall["a"], wall["b"]),
            "median_s": {k: timing.median_interval(v)[0] for k, v in values.items()},
            "per_rank": per_rank, "labels": labels, "paths": [r["path"] for r in results],
            "traces": [r["trace"] for r in results]}


def _step(forward, opt, data, after=None):
    def step():
        x, y = next(data)
        forward(x, y).backward()
        if after is not None:
            after()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def ddp(rank, world_size, batch_size=2, bucket_bytes=1 << 19):
    """The hand DDP with overlap on ("a") and off ("b"): one model, the switch flipped per step. Two
    sequences of 64 tokens, so that the 3.5 MB of gradients take a good part of backward's time to
    travel; 512 KiB buckets, so that the last one, exposed whatever the overlap, is small."""
    cfg = targets.config()
    net = tiny.build(cfg, seed=0, device=launch.device())
    hand = HandDDP(net, bucket_bytes)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    data = targets.stream(cfg, rank, batch_size)

    def mode(on):
        step = _step(net, opt, data, hand.finish)

        def run():
            hand.overlap = on
            step()
        return run
    return {"a": mode(True), "b": mode(False)}


def fsdp_config():
    """Wider and shorter than `targets.config`: a unit's all-gather (3 MiB) comparable to its compute."""
    return tiny.GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, hidden=256)


def fsdp2(rank, world_size, batch_size=2):
    """FSDP2 with each all-gather prefetched one unit ahead ("a") and without ("b"): two copies."""
    cfg, dev = fsdp_config(), launch.device()
    mesh = device_mesh(ParallelDims(dp=world_size), dev.type)["dp"]
    steps = {}
    for name, prefetch in (("a", True), ("b", False)):
        net = tiny.build(cfg, seed=0, device=dev)
        fully_shard_units(net, net.blocks, mesh)
        if prefetch:
            targets.prefetch_one_ahead(net, list(net.blocks))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        steps[name] = _step(net, opt, targets.stream(cfg, rank, batch_size))
    return steps


# which: (the two variants' steps, their names, the term compared)
PAIRS = {"ddp": (ddp, ("overlap on", "overlap off"), "exposed_comm_s"),
         "fsdp2": (fsdp2, ("prefetch one unit ahead", "no prefetch"), "exposed_comm_s"),
         "matmul": (collective_matmul.steps,
                    ("ring, transfer under the matmul", "ring, transfer waited first"),
                    "exposed_comm_s"),
         "moe": (moe_overlap.steps, ("two micro-batches overlapped", "one after the other"),
                 "exposed_comm_s"),
         "input": (input_pipeline.steps, ("prefetching workers", "loading in the loop"), "input_s")}


def record(rank, world_size, runs):
    """Several pairs in one job: ``runs`` is a list of (which, folder, repeats, options)."""
    # only the ring sends point-to-point messages, matched across ranks by the peer and tag its
    # trace records with the shapes; the others' traces need no shapes
    return [interleaved(rank, PAIRS[which][0](rank, world_size, **options), folder, repeats,
                        shapes=which == "matmul")
            for which, folder, repeats, options in runs]


def run(pairs, world_size=2, folder=None, repeats=6, timeout=600, **options):
    """Spawn ``world_size`` ranks once and compare each pair of ``pairs`` ("ddp", "fsdp2", "matmul",
    "moe", "input"); traces under ``folder``/<pair>. Returns {pair: `compare`'s result}."""
    for which in pairs:
        if which not in PAIRS:
            raise ValueError(f"unknown pair {which!r}; choose from {', '.join(PAIRS)}.")
    base = os.path.abspath(folder or os.path.join(tempfile.gettempdir(), "labs-profiles", "overlap"))
    runs = [(which, os.path.join(base, which), repeats, options.get(which, {})) for which in pairs]
    results = launch.spawn(record, world_size, runs, timeout=timeout)
    return {which: compare([r[i] for r in results], PAIRS[which][1], PAIRS[which][2])
            for i, which in enumerate(pairs)}
