"""Chapter 15: the book's training labs, each set up on one rank as a step the profiler can wrap.

    step = targets.build("fsdp2", rank, world_size)   # the model, wrapped; data; optimizer
    step()                                             # forward, backward, optimizer step

Each is the chapter's own piece, applied from outside to the tiny GPT, unchanged:
- ``ddp``: torch's DistributedDataParallel, 1 MiB buckets (chapter 2);
- ``hand-ddp``: chapter 2's `HandDDP`, the same buckets, overlap on (``overlap=False``: off);
- ``fsdp``: chapter 3's hand FSDP (`HandFSDP`), one unit per block, gathered when needed;
- ``fsdp2``: FSDP2's ``fully_shard`` per block; ``prefetch=True`` issues each unit's all-gather
  one unit ahead (explicit prefetch, asynchronous unshard), the default waits for each in turn;
- ``tp``: chapter 4's Megatron tensor parallelism over all ranks;
- ``1f1b``, ``gpipe``: chapter 5's executor running the schedule on ``world_size`` stages;
- ``3d``: chapter 17's tiny GPT on dp x tp x pp (tp = pp = 2) with ZeRO-1, every collective a
  hand ring of counted messages (`labs.threed.train3d`).
"""
import torch
import torch.distributed as dist

from labs import groups, model as tiny
from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.data_parallel import hand_ring
from labs.data_parallel.hand_ddp import HandDDP
from labs.launcher import launch
from labs.formulas import schedules
from labs.pipeline import executor
from labs.threed import layout3d, train3d
from labs.tensor_parallel import megatron
from labs.zero.fsdp import HandFSDP, fully_shard_units
from labs.zero.sharded_optimizer import ShardedOptimizer

LABS = ("ddp", "hand-ddp", "fsdp", "fsdp2", "tp", "1f1b", "gpipe", "3d")
# chapter 5's executor sends CPU tensors between stages, and the 3D run's hand rings with it:
# those labs run on gloo on every machine
BACKEND = {"1f1b": "gloo", "gpipe": "gloo", "3d": "gloo"}
BUCKET_BYTES = 1 << 20


def config(n_layer=4):
    """The model every data-parallel and sharded lab profiles: 4 layers, h = 128 (~0.9M parameters)."""
    return tiny.GPTConfig(vocab_size=256, seq_len=64, n_layer=n_layer, n_head=4, hidden=128)


def fsdp_unit_bytes(net, world_size, elem=4):
    """The hand FSDP's all-reduce bytes per step (its reduce-scatters, which gloo runs as all-reduces
    of the whole buffer): each unit's flat buffer, padded and not padded to a multiple of the ranks.
    Units: one per block, the root the rest. The two differ only where some unit's element count is
    not a multiple of ``world_size`` (on 3 ranks, every unit of `config`'s model)."""
    units = [sum(p.numel() for p in blk.parameters()) for blk in net.blocks]
    units.append(sum(p.numel() for p in net.parameters()) - sum(units))
    return {"padded": elem * sum(-(-n // world_size) * world_size for n in units),
            "unpadded": elem * sum(units)}


def check(lab, world_size, microbatches=4):
    """Refuse, in one sentence and before any rank starts, a lab the world size cannot run."""
    if lab not in LABS:
        raise ValueError(f"unknown lab {lab!r}; choose one of {', '.join(LABS)}.")
    if lab in ("ddp", "hand-ddp", "fsdp", "fsdp2", "tp") and world_size < 2:
        raise ValueError(f"--lab {lab} needs at least 2 ranks to communicate; got --world-size {world_size}.")
    if lab == "tp":
        megatron.check_degree(config(), world_size)
    if lab in ("1f1b", "gpipe"):
        if world_size < 2 or config(8).n_layer % world_size:
            raise ValueError(f"--lab {lab} cuts 8 layers into --world-size stages: use 2, 4 or 8, "
                             f"got {world_size}.")
        schedules.build(lab, world_size, microbatches)
    if lab == "3d" and world_size % 4:
        raise ValueError(f"--lab 3d runs tp = 2 x pp = 2 x dp = world_size / 4: --world-size must be a "
                         f"multiple of 4, got {world_size}.")


def build(lab, rank, world_size, batch_size=8, microbatches=4, **options):
    """This rank's part of ``lab``, as a function that runs one training step."""
    return BUILDERS[lab](rank, world_size, batch_size=batch_size, microbatches=microbatches, **options)


def _sgd_step(net, forward, opt, data):
    def step():
        x, y = next(data)
        forward(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def stream(cfg, rank, batch_size, same=False):
    """An endless stream of this rank's batches (the same on every rank for tensor parallelism)."""
    dev, i = launch.device(), 0
    while True:
        yield tiny.synthetic_batch(cfg, batch_size, seed=1000 * i + (0 if same else rank), device=dev)
        i += 1


def _ddp(rank, world_size, batch_size, **_):
    from torch.nn.parallel import DistributedDataParallel
    cfg = config()
    net = tiny.build(cfg, seed=0, device=launch.device())
    ddp = DistributedDataParallel(net, bucket_cap_mb=BUCKET_BYTES / 2**20)
    return _sgd_step(net, ddp, torch.optim.SGD(net.parameters(), lr=0.01), stream(cfg, rank, batch_size))


def _hand_ddp(rank, world_size, batch_size, overlap=True, **_):
    cfg = config()
    net = tiny.build(cfg, seed=0, device=launch.device())
    ddp = HandDDP(net, BUCKET_BYTES, overlap=overlap)
    opt, data = torch.optim.SGD(net.parameters(), lr=0.01), stream(cfg, rank, batch_size)

    def step():
        x, y = next(data)
        net(x, y).backward()   # the hand DDP averages the gradients when autograd ends
        ddp.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _fsdp(rank, world_size, batch_size, **_):
    cfg = config()
    net = tiny.build(cfg, seed=0, device=launch.device())
    HandFSDP(net, units=list(net.blocks))
    return _sgd_step(net, net, torch.optim.SGD(net.parameters(), lr=0.01), stream(cfg, rank, batch_size))


def _fsdp2(rank, world_size, batch_size, prefetch=False, **_):
    cfg, dev = config(), launch.device()
    net = tiny.build(cfg, seed=0, device=dev)
    fully_shard_units(net, net.blocks, device_mesh(ParallelDims(dp=world_size), dev.type)["dp"])
    if prefetch:
        prefetch_one_ahead(net, list(net.blocks))
    return _sgd_step(net, net, torch.optim.SGD(net.parameters(), lr=0.01), stream(cfg, rank, batch_size))


def prefetch_one_ahead(root, units):
    """FSDP2's explicit prefetch: in forward each unit issues the next unit's all-gather, in backward
    the previous one's. On a GPU FSDP2 overlaps through its all-gather stream; the CPU has no
    streams, so the unshard must also be asynchronous (``_set_unshard_async_op``) to run on gloo's
    thread while the current unit computes."""
    root._set_unshard_async_op(True)
    for here, ahead in zip(units, units[1:]):
        here.set_modules_to_forward_prefetch([ahead])
        ahead.set_modules_to_backward_prefetch([here])


def _tp(rank, world_size, batch_size, **_):
    cfg = config()
    net = tiny.build(cfg, seed=0, device=launch.device())
    megatron.apply_tensor_parallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    return _sgd_step(net, net, opt, stream(cfg, rank, batch_size, same=True))


def _pipeline(schedule):
    def build_stage(rank, world_size, batch_size, microbatches, **_):
        cfg, p = config(n_layer=8), world_size
        pieces = executor.split(tiny.build(cfg, seed=0), p)
        mine = [pieces[rank]]
        data = executor.microbatches(cfg, microbatches, max(1, batch_size // microbatches))
        opt = torch.optim.SGD(mine[0].parameters(), lr=0.01)
        actions = schedules.build(schedule, p, microbatches)[rank]

        def step():
            ex = executor.Executor(mine, rank, p, 1, schedules.costs(schedule), 0.0, data, microbatches,
                                   cfg.hidden)
            ex.run(actions)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return build_stage


def _three_d(rank, world_size, batch_size, microbatches, **_):
    lay = ParallelDims(tp=2, pp=2, dp=world_size // 4)
    g, cfg = groups.Groups(lay), layout3d.config()
    piece = train3d.build_rank(cfg, g)
    opt = ShardedOptimizer(piece.parameters(), torch.optim.Adam, stage=1, group=g.dp, lr=layout3d.LR)
    c, counter = g.coords, iter(range(10**9))

    def step():
        i = next(counter)
        batches = layout3d.step_batches(cfg, i, lay.dp, microbatches, layout3d.MICRO_BATCH)
        data = batches[c["dp"] * microbatches:(c["dp"] + 1) * microbatches]
        ex = train3d.Executor([piece], c["pp"], lay.pp, 1, schedules.costs("1f1b"), 0.0, data, microbatches,
                              cfg.hidden, stage_ranks=g.pp_ranks)
        with hand_ring.hand_collectives():
            ex.run(schedules.one_f_one_b(lay.pp, microbatches)[c["pp"]])
            opt.step()
            opt.zero_grad()
    dist.barrier()
    return step


BUILDERS = {"ddp": _ddp, "hand-ddp": _hand_ddp, "fsdp": _fsdp, "fsdp2": _fsdp2, "tp": _tp,
            "1f1b": _pipeline("1f1b"), "gpipe": _pipeline("gpipe"), "3d": _three_d}
