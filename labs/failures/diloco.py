"""Chapter 13: DiLoCo through torchft: H steps without communication, then one outer step.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1): every worker starts from the global
weights theta, takes H inner steps on its own data with its own inner optimizer (AdamW in the
paper), and the workers then average their pseudo-gradients Delta = theta - theta_i (the outer
gradient); an outer optimizer (Nesterov momentum in the paper) steps theta with Delta. One
all-reduce of the weights' size per H steps instead of one per step.

torchft implements it as ``torchft.local_sgd.DiLoCo``: hooks on the inner optimizer count the
inner steps, and every ``sync_every`` = H of them the fragment's pseudo-gradient is all-reduced
through the ``Manager`` (averaged over the replicas in the quorum), the weights are put back to
the saved global ones, and the outer optimizer steps if ``should_commit`` agrees
(torchft/local_sgd.py, ``_StreamingDiLoCoFragment.prepare_sync`` and ``perform_sync``).

Two ranks of the book's launcher are two replica groups here: rank 0 also runs the lighthouse;
each rank has its own TCPStore and Manager (synchronous quorum, as DiLoCo requires). On the
same data the lab trains torchft's DDP path (one ``Manager.allreduce`` of the gradient per step,
`torchft_replica.average`) and DiLoCo at several H; it counts the bytes handed to every
all-reduce, and checks that H = 1 with inner SGD (learning rate eta) and outer SGD (learning rate
1, no momentum) is DDP with SGD: theta - mean_i(theta - (theta - eta g_i)) = theta - eta mean_i g_i,
equal up to the rounding of theta - eta g_i, which a stated tolerance covers. With an inner Adam
it is not: each worker's Adam normalizes its own gradient by its own moments, and the mean of
normalized gradients is not the normalized mean DDP with Adam steps with.

    python -m labs.failures.diloco --json
"""
from datetime import timedelta

import torch
import torch.distributed as dist

from labs import model as tiny
from labs.failures import bigram, torchft_replica as rep
from labs.launcher import launch
from labs.measure import timing

ETA, ADAM_LR = 0.02, 3e-3
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9   # the paper's outer Nesterov (section 3)
# how often the lighthouse re-checks for a quorum; each request also checks at once (torchft's
# lighthouse.rs, "proactively run quorum tick"), so the tick matters only for a quorum that must wait
QUORUM_TICK_MS = 10


def _lighthouse(rank, tick_ms=QUORUM_TICK_MS):
    """Rank 0 runs the lighthouse (a Rust server, in this process); every rank learns its address."""
    holder = [None]
    if rank == 0:
        from torchft.coordination import LighthouseServer
        server = LighthouseServer(bind="[::]:0", min_replicas=dist.get_world_size(), quorum_tick_ms=tick_ms,
                                  heartbeat_timeout_ms=500, join_timeout_ms=10000)
        holder = [server.address()]
        _lighthouse.server = server   # keep it alive while the process runs
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _manager(name, rank, address, store, model, opt):
    from torchft import Manager, ProcessGroupGloo
    t = timedelta(seconds=30)
    return Manager(pg=ProcessGroupGloo(timeout=t), min_replica_size=dist.get_world_size(),
                   load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                               opt.load_state_dict(sd["optim"])),
                   state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                   replica_id=f"{name}_{rank}", lighthouse_addr=address, store_addr="127.0.0.1",
                   store_port=store.port, rank=0, world_size=1, use_async_quorum=False, timeout=t,
                   quorum_timeout=t, connect_timeout=t, init_sync=False)


def _counted(manager):
    """Count the bytes of every tensor handed to ``manager.allreduce`` (what goes on the wire, before
    gloo's framing); returns the list the counts go to."""
    counts, original = [], manager.allreduce

    def allreduce(tensor, *args, **kwargs):
        counts.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)
    manager.allreduce = allreduce
    return counts


def _inner(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=ETA)
    return torch.optim.AdamW(params, lr=ADAM_LR)


def _outer(kind, params):
    if kind == "sgd1":   # lr 1, no momentum: the outer step applies the averaged pseudo-gradient as is
        return torch.optim.SGD(params, lr=1.0)
    return torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)


def one_run(name, rank, address, store, steps, inner, h=None, outer=None, seed=0):
    """``steps`` inner steps: torchft DDP (``h`` None: one all-reduce per step) or DiLoCo every ``h``;
    ``seed`` sets the initial weights (the batches are the same for every seed)."""
    from torchft.local_sgd import DiLoCo
    torch.manual_seed(seed)
    model = tiny.build(bigram.CFG, seed=seed)
    opt = _inner(inner, model.parameters())
    manager = _manager(name, rank, address, store, model, opt)
    counts = _counted(manager)
    losses, t0 = [], timing.now()
    diloco = DiLoCo(manager, [model], opt, _outer(outer, model.parameters()), sync_every=h) if h else None
    with diloco if diloco else _Quorum(manager):
        for s in range(steps):
            if not diloco:
                manager.start_quorum()
            opt.zero_grad()
            x, y = bigram.batch(s, rank)
            model(x, y).backward()
            if not diloco:
                rep.average(manager, model)
                if manager.should_commit():
                    opt.step()
            else:
                opt.step()            # DiLoCo's hooks sync on every h-th inner step
            losses.append(bigram.held_out_loss(model))
    manager.shutdown(wait=False)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"losses": losses, "allreduce_bytes": sum(counts), "allreduce_calls": len(counts),
            "weights": weights, "seconds": timing.now() - t0, "commits": manager.current_step()}


class _Quorum:
    def __init__(self, manager):
        self.manager = manager

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


RUNS = (("ddp_sgd", "sgd", None, None), ("diloco_h1_sgd", "sgd", 1, "sgd1"),
        ("ddp_adamw", "adamw", None, None), ("diloco_h1_adamw_sgd1", "adamw", 1, "sgd1"))


@launch.on_cpu("torchft's replica groups here are its ProcessGroupGloo on CPU tensors (on GPUs "
               "torchft gives each replica ProcessGroupNCCL); the launcher's group only spreads the "
               "lighthouse's address")
def train(rank, world_size, steps, hs, seeds, tick_ms=QUORUM_TICK_MS):
    from torch.distributed import TCPStore
    torch.set_num_threads(1)
    address = _lighthouse(rank, tick_ms)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    runs = tuple(r + (0,) for r in RUNS) + tuple(
        (f"diloco_h{h}" + (f"_seed{seed}" if seed else ""), "adamw", h, "nesterov", seed)
        for seed in seeds for h in hs)
    out = {}
    for name, inner, h, outer, seed in runs:
        dist.barrier()   # every replica starts the run together
        out[name] = one_run(name, rank, address, store, steps, inner, h, outer, seed)
    return out


def bound(steps, weights):
    """A tolerance, not a proven bound: how far H = 1 (inner SGD, outer SGD at 1) may land from DDP
    with SGD, per element, in fp32.

    Per step DiLoCo forms theta_i = fl(theta - eta g_i) (rounding error at most u |theta_i|, u =
    2^-24), then Delta_i = theta - theta_i, exact by Sterbenz's lemma only where theta_i is within
    a factor 2 of theta (a step that moves a weight by more than half its size breaks it), so
    its pseudo-gradient is eta g_i off by at most u |theta_i|; averaging and the outer step round
    like DDP's own update. So each step adds at most about 2 u max|theta| per element (rounded up
    here to 4 u, for the gradients evaluated at weights that already differ by that much), and
    ``steps`` steps at most 4 u max|theta| ``steps``."""
    return 4 * 2.0 ** -24 * float(weights.abs().max()) * steps


def diloco(world_size=2, steps=64, hs=(1, 8, 32), seeds=(0,), timeout=300.0,
           tick_ms=QUORUM_TICK_MS):
    """DDP and DiLoCo through torchft on ``world_size`` replica groups of one rank each; the DiLoCo
    runs at every H once per initial-weight seed in ``seeds`` (seed 0's runs are ``diloco_h{H}``,
    another seed's ``diloco_h{H}_seed{seed}``)."""
    if any(h < 1 or steps % h for h in hs):
        raise ValueError(f"--steps {steps} must be a multiple of every H in {hs}: each run ends on a sync.")
    if 0 not in seeds:
        raise ValueError("seeds must include 0, the seed of the DDP runs it is compared with")
    ranks = launch.spawn(train, world_size, steps, tuple(hs), tuple(seeds), tick_ms, timeout=timeout)
    r0 = ranks[0]
    agree = {n: all(torch.equal(r[n]["weights"], r0[n]["weights"]) for r in ranks) for n in r0}
    out = {n: {k: v for k, v in run.items() if k != "weights"} | {"replicas_agree": agree[n],
           "bytes_per_step": run["allreduce_bytes"] / steps} for n, run in r0.items()}
    sgd_gap = float((r0["diloco_h1_sgd"]["weights"] - r0["ddp_sgd"]["weights"]).abs().max())
    adam_gap = float((r0["diloco_h1_adamw_sgd1"]["weights"] - r0["ddp_adamw"]["weights"]).abs().max())
    return {"runs": out, "steps": steps, "hs": list(hs), "seeds": list(seeds), "world_size": world_size,
            "params": r0["ddp_sgd"]["weights"].numel(),
            "h1_sgd_max_weight_diff": sgd_gap, "h1_bound": bound(steps, r0["ddp_sgd"]["weights"]),
            "h1_adam_max_weight_diff": adam_gap}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("DiLoCo through torchft beside DDP: bytes per step, loss at H = 1, 8, 32, and "
                   "H = 1 with SGD equal to DDP.", world_size_default=2)
    p.add_argument("--steps", type=cli.at_most(512, "a short run"), default=64)
    args = cli.parse(p, argv)
    r = diloco(args.world_size, args.steps, timeout=args.timeout)
    cli.report(r, args, f"H = 1 with SGD: weights within {r['h1_sgd_max_weight_diff']:.1e} of DDP's "
               f"(tolerance {r['h1_bound']:.1e}); with inner AdamW {r['h1_adam_max_weight_diff']:.1e}; " +
               "; ".join(f"{n}: {v['bytes_per_step']:,.0f} B/step, loss {v['losses'][-1]:.3f}"
                         for n, v in r["runs"].items()))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
