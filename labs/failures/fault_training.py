"""The tiny data-parallel training job that chapter 13's faults are injected into (`labs.failures.scenarios`).

A linear regression y = x w* + noise, trained by plain DDP arithmetic: each rank computes the
gradient of its own rows, one all-reduce averages the flat gradient, SGD with momentum steps. Every
batch is a pure function of its id, and the momentum buffer lives in the optimizer, so a restart
that restores (weights, optimizer, step, next batch id) continues bit for bit as if nothing had
happened: the property the kill and loss-spike scenarios assert.
"""
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

DIM, ROWS = 16, 8  # features; rows per rank per step
LR, MOMENTUM = 0.05, 0.9
# why the job's rank functions run on the CPU with gloo on every machine (`launch.on_cpu`)
ON_CPU = ("chapter 13's fault job: a CPU stand-in for training whose replicas are compared by hashing "
          "their bytes on the host (digest: hashlib over .numpy()); the faults are what it measures")


class MomentumSGD:
    """torch.optim.SGD's update with momentum (dampening 0): buf = mu buf + g; p -= lr buf.

    Written out because building a torch.optim optimizer imports torch._dynamo, about 2 s of CPU
    in every freshly forked rank; the momentum buffers are the state a checkpoint must keep."""

    def __init__(self, params, lr=LR, momentum=MOMENTUM):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.bufs = [None] * len(self.params)

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            buf = self.bufs[i]
            self.bufs[i] = p.grad.clone() if buf is None else buf.mul_(self.momentum).add_(p.grad)
            p.add_(self.bufs[i], alpha=-self.lr)

    def state_dict(self):
        return {"bufs": [None if b is None else b.clone() for b in self.bufs]}

    def load_state_dict(self, state):
        self.bufs = [None if b is None else b.clone() for b in state["bufs"]]


def make_model():
    """The same initial weights on every rank (a seeded init, as DDP's broadcast would give)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    return model, MomentumSGD(model.parameters())


def batch(batch_id, rank, world_size, scale=1.0):
    """Rows of global batch ``batch_id`` that belong to ``rank``: (ROWS, DIM) inputs, (ROWS, 1) labels.

    ``scale`` multiplies the inputs: a corrupted batch (chapter 13's loss spike)."""
    w_true = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1000 + batch_id)
    x = torch.randn(world_size * ROWS, DIM, generator=g)               # (W*B, D)
    y = x @ w_true + 0.1 * torch.randn(world_size * ROWS, 1, generator=g)  # (W*B, 1)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    return x[rows] * scale, y[rows]


def local_grad(model, x, y):
    """(loss of this rank's rows, flat gradient (P,)) without touching any other rank."""
    model.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def average(flat, world_size, group=None):
    """DDP's gradient all-reduce on a copy: sum over ranks, divided by world_size."""
    out = flat.clone()
    dist.all_reduce(out, group=group)
    return out / world_size


def apply(model, opt, flat):
    """Put the flat averaged gradient back into .grad and take one optimizer step."""
    i = 0
    for p in model.parameters():
        p.grad.copy_(flat[i:i + p.numel()].view_as(p))
        i += p.numel()
    opt.step()


def mean_loss(loss, world_size, group=None):
    t = loss.clone().reshape(1)
    dist.all_reduce(t, group=group)
    return (t / world_size).item()


def step(model, opt, batch_id, rank, world_size, scale=1.0, group=None):
    """One plain DDP step; returns the loss averaged over ranks (the same float on every rank)."""
    loss, g = local_grad(model, *batch(batch_id, rank, world_size, scale))
    apply(model, opt, average(g, world_size, group))
    return mean_loss(loss, world_size, group)


def digest(t):
    """A 64-bit hash of a tensor's exact bytes, as an int64 tensor (all-gatherable).

    Exact: a single flipped bit changes it, where a norm or a checksum of floats might not."""
    raw = hashlib.sha256(t.detach().contiguous().numpy().tobytes()).digest()[:8]
    return torch.tensor([int.from_bytes(raw, "little", signed=True)], dtype=torch.int64)


def gather(t, world_size):
    """all_gather of a 1-element tensor from every rank, as a list in rank order."""
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t)
    return [o.item() for o in out]


def state(model, opt, step_, next_batch):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": opt.state_dict(),
            "step": step_, "next_batch": next_batch}


def restore(model, opt, snap):
    model.load_state_dict(snap["model"])
    opt.load_state_dict(snap["optim"])
    return snap["step"], snap["next_batch"]


def save(folder, snap):
    """Atomic checkpoint: write under a temporary name, then rename (a killed writer leaves the
    previous checkpoint as the latest, never half a file)."""
    final = os.path.join(folder, f"step{snap['step']:06d}.pt")
    torch.save(snap, final + ".tmp")
    os.replace(final + ".tmp", final)
    return final


def latest(folder):
    """The newest complete checkpoint in ``folder`` (loaded), or None."""
    names = sorted(n for n in os.listdir(folder) if n.startswith("step") and n.endswith(".pt"))
    return torch.load(os.path.join(folder, names[-1]), weights_only=False) if names else None
