"""Rank functions for tests/test_box.py: spawned ranks import them by name."""
import torch
import torch.distributed as dist

from labs.launcher import launch
from labs.memory_budget import budget
from labs import model as tiny


class _FakeCuda:
    """torch.cuda's memory counters as a log: which was called, in what order, around the step."""

    def __init__(self, log):
        self.log = log

    def patch(self, monkey):
        for name in ("synchronize", "reset_peak_memory_stats"):
            monkey(name, lambda *a, _n=name, **k: self.log.append(_n))
        monkey("max_memory_allocated", lambda *a, **k: self.log.append("max_memory_allocated") or 12345)
        monkey("memory_allocated", lambda *a, **k: 0)
        monkey("is_available", lambda: True)
        monkey("is_initialized", lambda: True)


def peak_reset_order(rank, world_size, recipes):
    """budget.data_parallel_step for each recipe with torch.cuda's counters faked (the tensors stay
    on the CPU): the log of counter calls and of the step's first batch, and what each step reports."""
    log, saved = [], {}

    def monkey(name, fn):
        saved[name] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, fn)
    _FakeCuda(log).patch(monkey)
    batch = tiny.synthetic_batch
    budget.tiny.synthetic_batch = lambda *a, **k: log.append("batch") or batch(*a, **k)
    try:
        peaks = [budget.data_parallel_step(tiny.GPTConfig(), r, rank, 2)["cuda_peak_bytes"] for r in recipes]
    finally:
        budget.tiny.synthetic_batch = batch
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
    return {"log": log, "peaks": peaks}


# ---- rank functions the device audit (tests/device_audit.py) must flag, and one it must pass -----

def audit_forgets_the_device_in_a_collective(rank, world_size):
    t = torch.ones(4)                                          # NCCL would refuse this
    dist.all_reduce(t)
    return t.sum().item()


def audit_mixes_devices(rank, world_size):
    w = torch.ones(4, 4, device=launch.device())
    return (w @ torch.ones(4)).sum().item()                    # a CPU vector times a GPU matrix


def audit_draws_on_the_gpu_from_a_cpu_generator(rank, world_size):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(4, generator=g, device=launch.device()).sum().item()


def audit_clean(rank, world_size):
    """What the labs do right: draw on the CPU and move, build on the device, index with CPU
    indices, make new tensors on another tensor's device, bring results back with .cpu()."""
    dev = launch.device()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(dev)   # (4, 8)
    net = torch.nn.Linear(8, 8).to(dev)
    loss = net(x[torch.tensor([0, 2])]).square().mean()
    loss.backward()
    total = torch.zeros(8, device=x.device) + net.weight.grad.sum(0)
    dist.all_reduce(total)
    return {"loss": loss.item(), "total": total.cpu(), "scalar": (total * torch.tensor(2.0)).sum().item()}
