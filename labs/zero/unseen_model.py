"""Chapter 3: a model none of the hand pieces was written for, trained under each of them.

The hand-built pieces are drop-ins for the library's (DESIGN: "hand-built pieces share the
library's interface"): the sharded optimizer (`labs.zero.sharded_optimizer`, ZeRO-1/2) wraps any
``torch.optim`` class over any parameters, the hand FSDP (`labs.zero.fsdp`, ZeRO-3) wraps any
``nn.Module`` by units. `ToyLM` has every case such a wrapper can get wrong: a frozen layer
(``requires_grad=False``), an embedding tied to the head (one Parameter, two uses), a branch that
gets no gradient on odd steps, and fp32 master weights with bf16 compute. `train_toy` runs one
ordinary training loop (forward, backward, ``step()``, ``zero_grad()``) under "zero1", "zero2",
"fsdp" or "fsdp2"; `toy_reference` is the single process all of them must reproduce.
"""
import torch

from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.launcher import launch
from labs.zero import adam_drift, stages
from labs.zero.fsdp import HandFSDP, fully_shard_units
from labs.zero.sharded_optimizer import ShardedOptimizer, unit_buckets


class ToyLM(torch.nn.Module):
    """Embedding, a frozen layer, a stack of MLP blocks, a branch used only when asked, and a
    head tied to the embedding: every case a sharding wrapper can get wrong."""

    def __init__(self, vocab=48, hidden=24, depth=3):
        super().__init__()
        nn = torch.nn
        self.emb = nn.Embedding(vocab, hidden)
        self.frozen = nn.Linear(hidden, hidden).requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden),
                                                  nn.GELU(), nn.Linear(2 * hidden, hidden))
                                    for _ in range(depth))
        self.aux = nn.Linear(hidden, hidden)       # no gradient in the steps that skip it
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.emb.weight         # tied: one Parameter, two uses

    def forward(self, idx, targets, use_aux=False):
        x = self.frozen(self.emb(idx))                                 # (B, T, H)
        for block in self.blocks:
            x = x + block(x)
        if use_aux:
            x = x + self.aux(x)
        logits = self.head(x).float()                                  # (B, T, V), loss in fp32
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def toy_batch(step, rank, batch_size=2, seq=8, vocab=48):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], step % 2 == 0   # the branch runs on even steps only


def toy_model():
    """fp32 weights that bf16 represents exactly, so every recipe starts from the same weights."""
    torch.manual_seed(0)
    return ToyLM().to(torch.bfloat16).float()


def toy_reference(world_size, steps=4, lr=1e-3, batch_size=2):
    """One process, fp32 master + bf16 compute, every rank's batch as one micro-batch of gradient
    accumulation (the sum of bf16 gradients, then / N): data parallelism's single-process twin.
    Result: losses, params (the fp32 masters at the end) and first_grad ({name: the first step's
    averaged fp32 gradient}, what `grad_error` holds each scheme's to).

    It runs on one intra-op thread, as each spawned rank does: CPU kernels split reductions (a
    LayerNorm's weight gradient) by thread, so another thread count rounds differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _toy_reference(world_size, steps, lr, batch_size)
    finally:
        torch.set_num_threads(threads)


def _toy_reference(world_size, steps, lr, batch_size):
    master = toy_model()
    work = toy_model().to(torch.bfloat16)        # the bf16 copy forward and backward use
    opt = torch.optim.Adam([p for p in master.parameters() if p.requires_grad], lr=lr)
    losses, first_grad = [], None
    for step in range(steps):
        losses.append([])
        for r in range(world_size):
            x, y, aux = toy_batch(step, r, batch_size)
            loss = work(x, y, use_aux=aux)
            loss.backward()
            losses[-1].append(loss.item())
        with torch.no_grad():
            for m, w in zip(master.parameters(), work.parameters()):
                m.grad = None if w.grad is None else (w.grad / world_size).float()
                w.grad = None
            if step == 0:
                first_grad = {k: v.grad.clone() for k, v in master.named_parameters() if v.grad is not None}
            opt.step()
            for m, w in zip(master.parameters(), work.parameters()):
                w.copy_(m)
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in master.named_parameters()},
            "first_grad": first_grad}


def grad_error(pieces, reference_grad):
    """Max |a rank's averaged gradient - one process's| over its pieces ((name, offset, gradient),
    as `train_toy` reports them), relative to the largest gradient: a few 2^-8 for bf16 sums in
    another order, about 1 for a replica that skipped the all-reduce or averaged with a wrong 1/N."""
    return stages._grad_error(pieces, reference_grad)


def update_error(params, reference):
    """`adam_drift.update_error` of ``params`` ({name: final weights}) from `toy_model`'s weights,
    against ``reference`` (`toy_reference`'s result): exactly 1 for a run that never stepped."""
    start, names = dict(toy_model().named_parameters()), list(reference["params"])
    start, got, want = (torch.cat([d[k].detach().reshape(-1) for k in names])
                        for d in (start, params, reference["params"]))
    return adam_drift.update_error(start, got, want)


def _first_grads(net, opt, scheme):
    """(name, offset, averaged gradient) for what this rank updates, between backward and step;
    FSDP2's gradients are DTensors, gathered whole (a collective every rank calls)."""
    if scheme == "fsdp2":
        return [(k, 0, p.grad.full_tensor().reshape(-1).cpu()) for k, p in net.named_parameters()
                if p.grad is not None]
    return [(k, o, g.cpu()) for k, o, g in stages._shard_grads(net, opt)]


SCHEMES = ("zero1", "zero2", "fsdp", "fsdp2")


def train_toy(rank, world_size, scheme, steps=4, lr=1e-3, batch_size=2):
    """Train `ToyLM` with fp32 master + bf16 compute under ``scheme``: "zero1", "zero2" (the
    sharded optimizer), "fsdp" (this file) or "fsdp2". Result: losses (this rank's, per step),
    params ({name: full fp32 master weights}), unsharded_bytes_after_step (hand FSDP: bytes of
    full weights still allocated after the step, 0 when every unit freed its gather),
    max_units_gathered (hand FSDP: the most units holding full weights at any moment),
    first_grads (the first step's averaged gradient of what this rank updates, for `grad_error`)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; use one of {', '.join(SCHEMES)}.")
    dev = launch.device()
    net = toy_model().to(dev)
    units = [net.frozen, *net.blocks]
    if scheme in ("zero1", "zero2"):
        net = net.to(torch.bfloat16)
        opt = ShardedOptimizer(net.parameters(), torch.optim.Adam, stage=int(scheme[-1]), lr=lr,
                                    buckets=unit_buckets(net, units))
    elif scheme == "fsdp":
        hand = HandFSDP(net, units, compute_dtype=torch.bfloat16)
        opt = torch.optim.Adam(net.parameters(), lr=lr)
    elif scheme == "fsdp2":
        mesh = device_mesh(ParallelDims(dp=world_size), dev.type)["dp"]
        fully_shard_units(net, units, mesh, torch.bfloat16)
        opt = torch.optim.Adam(net.parameters(), lr=lr)
    losses, first = [], None  # this rank's loss at each step
    for step in range(steps):
        x, y, aux = toy_batch(step, rank, batch_size)
        opt.zero_grad()
        loss = net(x.to(dev), y.to(dev), use_aux=aux)
        loss.backward()
        first = _first_grads(net, opt, scheme) if step == 0 else first
        opt.step()
        losses.append(loss.item())
    unsharded_bytes, most = 0, None
    if scheme == "fsdp":
        params = hand.full_parameters()
        unsharded_bytes = sum(u.full.untyped_storage().nbytes() for u in hand.units)
        most = hand.max_units_gathered
    elif scheme == "fsdp2":
        params = {k: v.full_tensor().detach() for k, v in net.named_parameters()}
    else:
        masters = opt.full_masters()
        params = {k: masters[v] if v in masters else v.detach().float() for k, v in net.named_parameters()}
    params = {k: v.cpu() for k, v in params.items()}
    return {"losses": losses, "params": params, "unsharded_bytes_after_step": unsharded_bytes,
            "max_units_gathered": most, "first_grads": first}


def train_toy_all(rank, world_size, steps=4):
    """`train_toy` for every scheme in one job: {scheme: result}."""
    return {scheme: train_toy(rank, world_size, scheme, steps) for scheme in SCHEMES}
