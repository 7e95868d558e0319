"""Chapter 15: the source notes' exercise as one command: a model of OPT-1.3B's shapes trained with
DDP, with FSDP2 FULL_SHARD, and with FSDP2 plus activation checkpointing; the peak memory per rank
measured, and the communication read from the profiler's traces.

    python -m labs.profiling.opt_exercise --world-size 2 --json

OPT-1.3B (Zhang et al. 2022, arXiv 2205.01068, Table 1; facebook/opt-1.3b's config.json): 24
layers, hidden 2048, 32 heads, FFN 8192, vocabulary 50272, 2048 positions, input embedding tied
to the output head. The book's tiny GPT (`labs.model`) has exactly these shapes (its MLP is 4h =
8192 wide), with GeLU where OPT has ReLU and a 2048-row position table where OPT keeps two more
rows (an offset of 2): neither changes a matmul or a weight's size beyond those 4096 numbers.
Weights are random; nothing is downloaded.

``scale`` divides the hidden size, the heads (each head stays 64 wide), the vocabulary and the
sequence, and keeps the 24 layers: 1 is the real size, which runs on a GPU box; on the CPU the
command uses `CPU_SCALE`, whose model trains a step in about a second on one core.

Per mode and rank: the peak bytes during one training step (zero_grad, forward, backward, AdamW
step) from `labs.measure.memory.PeakMemory` (live tensor storage on the CPU; on a GPU also
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``), the bytes held between
steps (storage accounting), and from the traces of the next steps the communication per
operation: calls, bytes the spans record, seconds in flight and exposed.
"""
import os
import tempfile

import torch
import torch.distributed as dist

from labs import model as tiny
from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.launcher import launch
from labs.measure import memory
from labs.profiling import analysis, lab, trace
from labs.recompute.pipeline_memory import Checkpointed   # chapter 9's "full" policy, one block at a time
from labs.zero.fsdp import fully_shard_units

OPT_1_3B = {"n_layer": 24, "hidden": 2048, "n_head": 32, "ffn": 8192, "vocab_size": 50272, "seq_len": 2048}
CPU_SCALE = 16                 # h = 128, 2 heads, V = 3142, s = 128 on the CPU
MODES = ("ddp", "fsdp2", "fsdp2+ac")


def config(scale=1):
    """OPT-1.3B's shapes divided by ``scale`` (layers kept), as the book's GPT config."""
    s = OPT_1_3B
    for name in ("hidden", "n_head", "vocab_size", "seq_len"):
        if s[name] % scale and name != "vocab_size":
            raise ValueError(f"scale {scale} does not divide OPT-1.3B's {name} = {s[name]}; "
                             "use a power of 2 up to 32.")
    if scale < 1 or s["n_head"] % scale:
        raise ValueError(f"scale must be a power of 2 from 1 to 32, got {scale}.")
    cfg = tiny.GPTConfig(vocab_size=s["vocab_size"] // scale, seq_len=s["seq_len"] // scale,
                         n_layer=s["n_layer"], n_head=s["n_head"] // scale, hidden=s["hidden"] // scale)
    assert 4 * cfg.hidden == s["ffn"] // scale   # the tiny GPT's MLP is 4h: OPT's FFN
    return cfg


def build(cfg, device):
    """The GPT with its head tied to the token embedding, as OPT ties them."""
    net = tiny.build(cfg, seed=0, device=device)
    net.head.weight = net.tok_emb.weight
    return net


def wrap(mode, net, world_size):
    """The model under ``mode``; returns what the training loop calls."""
    dev = launch.device()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(net)
    if mode == "fsdp2+ac":
        for i, block in enumerate(net.blocks):
            # the recompute reruns the inner block after the unit's pre-backward gather, and calls no
            # FSDP-hooked module: nothing gathers again (the notebook asserts equal calls and bytes)
            net.blocks[i] = Checkpointed(block)
    # FULL_SHARD: each unit's weights gathered for its forward and again for its backward
    fully_shard_units(net, net.blocks, device_mesh(ParallelDims(dp=world_size), dev.type)["dp"])
    return net


def one_mode(rank, world_size, mode, scale, folder, steps=2, batch_size=1):
    """Build, two warm-up steps (AdamW creates its state; DDP rebuilds its buckets in the second
    step's forward), one steady-state step measured for memory, ``steps`` steps under the profiler.
    Returns peak and held bytes, and the trace read back."""
    cfg, dev = config(scale), launch.device()
    net = build(cfg, dev)
    model = wrap(mode, net, world_size)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    data = [tiny.synthetic_batch(cfg, batch_size, seed=100 * i + rank, device=dev) for i in range(steps + 3)]

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
    for warm in data[:2]:
        step(*warm)
    dist.barrier()
    with memory.PeakMemory(net, opt, *data[2]) as mem:
        step(*data[2])
    held = memory.state_bytes(net, opt)
    with trace.Recorder(os.path.join(folder, mode.replace("+", "-")), rank, memory=False, gz=False) as rec:
        for i in range(steps):
            dist.barrier()
            with rec.step(i):
                step(*data[i + 3])
    return {"mode": mode, "peak": mem.result(), "held": held, "params": tiny.num_params(net),
            "trace": trace.load(rec.path), "wall_s": rec.steps, "path": rec.path}


def run_modes(rank, world_size, modes, scale, folder, steps=2):
    return [one_mode(rank, world_size, mode, scale, folder, steps) for mode in modes]


def summarize(results, modes):
    """The memory table and the communication breakdown, one row per mode (rank 0's and the max)."""
    out = {}
    for i, mode in enumerate(modes):
        runs = [r[i] for r in results]
        per_rank = analysis.analyze([r["trace"] for r in runs])
        comm = {}
        for rank_runs, rows in zip(runs, per_rank):
            for name, row in analysis.comm_by_op(rank_runs["trace"]).items():
                mine = comm.setdefault(name, {"calls": 0, "bytes": 0, "seconds": 0.0})
                for k in mine:
                    mine[k] += row[k] / len(runs)
        totals = [analysis.totals(rows) for rows in per_rank]
        out[mode] = {"peak_bytes": [r["peak"]["peak_bytes"] for r in runs],
                     "cuda_peak_bytes": [r["peak"]["cuda_peak_bytes"] for r in runs],
                     "held_bytes": [r["held"]["total"] for r in runs], "held": runs[0]["held"],
                     "params": runs[0]["params"], "comm_by_op": comm,
                     "steps": len(totals[0]) and totals[0]["steps"],
                     "exposed_comm_s": sum(t["exposed_comm_s"] for t in totals) / len(totals),
                     "comm_s": sum(t["comm_s"] for t in totals) / len(totals),
                     "step_s": sum(t["step_s"] for t in totals) / len(totals),
                     "paths": [r["path"] for r in runs]}
    return out


def run(world_size=2, scale=None, modes=MODES, folder=None, steps=2, timeout=900):
    """Every mode in one job; ``scale`` None: 1 on GPUs (NCCL, one per rank), `CPU_SCALE` otherwise."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}.")
    if scale is None:
        scale = 1 if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else CPU_SCALE
    config(scale)
    folder = os.path.abspath(folder or os.path.join(tempfile.gettempdir(), "labs-profiles", "opt"))
    results = launch.launch(run_modes, world_size, list(modes), scale, folder, steps, timeout=timeout)
    if results is None:
        return None
    return {"scale": scale, "config": vars(config(scale)), "world_size": world_size, "folder": folder,
            "modes": summarize(results, list(modes))}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("OPT-1.3B's shapes (random weights) under DDP, FSDP2 FULL_SHARD and FSDP2 + activation "
                   "checkpointing: peak memory per rank and the communication from torch.profiler traces.")
    p.add_argument("--scale", type=cli.positive_int, default=None,
                   help=f"divide hidden, heads, vocabulary and sequence by this (default: 1 on GPUs, "
                   f"{CPU_SCALE} on the CPU)")
    p.add_argument("--steps", type=cli.at_most(10, "profiled steps"), default=2)
    p.add_argument("--out", default=None, help="folder for the traces")
    lab.longer_timeout(p, 900)
    args = cli.parse(p, argv)
    r = run(args.world_size, args.scale, MODES, args.out, args.steps, args.timeout)
    if r is None:
        return
    lines = [f"OPT-1.3B shapes / {r['scale']} on {r['world_size']} ranks ({r['config']['hidden']} hidden, "
             f"{r['config']['seq_len']} tokens); traces in {r['folder']}"]
    for mode, m in r["modes"].items():
        ops = ", ".join(f"{k.split(':')[1]} {v['calls']:.0f} calls {v['bytes'] / 2**20:.1f} MiB"
                        for k, v in sorted(m["comm_by_op"].items()))
        lines.append(f"{mode:9s} peak {max(m['peak_bytes']) / 2**20:8.1f} MiB per rank, held "
                     f"{max(m['held_bytes']) / 2**20:7.1f} MiB; per step {ops}")
    cli.report(r, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
