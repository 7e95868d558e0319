"""Chapter 3: ZeRO stages 1, 2 and 3 built by hand, and FSDP2 beside them.

ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054) removes data parallelism's redundancy by giving
each of N ranks a 1/N shard of what the mixed-precision recipe holds (chapter 1: 2 + 2 + 12 bytes
per parameter): stage 1 shards the optimizer state (4 + 12/N), stage 2 also the gradients
(2 + 14/N), stage 3 also the weights (16/N). Per step each rank sends, with the ring's
(N-1)/N factor and Psi bf16 elements (2 bytes each):
- DDP: all-reduce of the gradients, 2(N-1)/N * 2Psi bytes;
- ZeRO-1 and 2: reduce-scatter of the gradients + all-gather of the updated weights: the same;
- ZeRO-3: all-gather before forward, again before backward, reduce-scatter: 3(N-1)/N * 2Psi, 1.5x.

The weights live in one flat bf16 buffer padded to a multiple of N (the module's parameters are
views into it, as in FSDP1), so a shard is a slice and stage 3 can free the whole buffer between
uses by shrinking its storage to zero bytes.

    python -m labs.zero --world-size 3 --stage 3 --steps 3 --json
"""
import torch
import torch.distributed as dist

from labs import budget, comm, launch, memory, model as tiny, precision

STAGES = (0, 1, 2, 3)
BF16 = 2


class FlatWeights:
    """The model's bf16 weights as views into one flat buffer of ``padded`` elements."""

    def __init__(self, model, n, rank):
        self.params = list(model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // n) * n     # round up to a multiple of N; the tail is zeros
        self.shard = self.padded // n
        self.mine = slice(rank * self.shard, (rank + 1) * self.shard)
        self.full = torch.zeros(self.padded, dtype=torch.bfloat16, device=self.params[0].device)
        offset = 0
        for p in self.params:
            self.full[offset:offset + p.numel()].copy_(p.data.view(-1))
            p.data = self.full[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def free(self):
        """Drop the full weights (stage 3 between uses); the parameter views stay, empty."""
        self.full.untyped_storage().resize_(0)

    def gather(self, shard):
        """All-gather every rank's shard into the full buffer. Writing through ``.data`` keeps
        autograd's version counters untouched: the weights saved for backward are refilled, not
        modified."""
        self.full.untyped_storage().resize_(self.padded * BF16)
        comm.all_gather(self.full.data, shard)

    def take_grads(self):
        """Backward's gradients, packed into one padded flat bf16 buffer; ``.grad`` is released."""
        flat = torch.zeros(self.padded, dtype=torch.bfloat16, device=self.full.device)
        torch.cat([p.grad.view(-1) for p in self.params], out=flat[:self.numel])
        for p in self.params:
            p.grad = None
        return flat


class ZeRO:
    """One training step of DDP (stage 0) or ZeRO-1/2/3 with mixed-precision Adam."""

    def __init__(self, model, stage, lr=1e-3, zero1_allreduce=False):
        if stage not in STAGES:
            raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}.")
        self.n, self.rank = dist.get_world_size(), dist.get_rank()
        self.stage, self.lr, self.zero1_allreduce = stage, lr, zero1_allreduce
        self.model = model.to(torch.bfloat16)
        self.flat = FlatWeights(self.model, self.n, self.rank)
        owned = self.flat.full if stage == 0 else self.flat.full[self.flat.mine]
        self.master = owned.float()               # fp32 master weights of what this rank updates
        self.m, self.v = torch.zeros_like(self.master), torch.zeros_like(self.master)
        self.t, self.grad = 0, None
        if stage == 3:                             # keep only my shard of the bf16 weights
            self.weights = owned.clone()
            self.flat.free()

    def step(self, x, y, inspect=None):
        """Forward, backward, gradient reduction, Adam on what this rank owns, weights back.

        ``inspect``, a list, receives a copy of the averaged gradient this rank updates with.
        """
        if self.stage == 3:
            self.flat.gather(self.weights)                    # all-gather 1: for forward
        loss = self.model(x, y)
        if self.stage == 3:
            self.flat.free()                                  # as ZeRO-3 frees after each layer
            self.flat.gather(self.weights)                    # all-gather 2: for backward
        loss.backward()
        if self.stage == 3:
            self.flat.free()
        full_grad = self.flat.take_grads()
        if self.stage == 0 or self.zero1_allreduce:
            comm.all_reduce(full_grad)
            full_grad.div_(self.n)
            mine = full_grad if self.stage == 0 else full_grad[self.flat.mine]
        else:
            mine = torch.empty(self.flat.shard, dtype=torch.bfloat16, device=full_grad.device)
            comm.reduce_scatter(mine, full_grad)              # sum of my shard, from every rank
            mine.div_(self.n)
        if inspect is not None:
            inspect.append(mine.float().clone())
        # What stays between steps: stage 0-1 keep the full gradient, stage 2-3 only their shard.
        self.grad = full_grad if self.stage <= 1 else mine
        self.t += 1
        precision.adam_update(self.master, mine.float(), self.m, self.v, self.t, self.lr)
        if self.stage == 0:
            self.flat.full.copy_(self.master)
        elif self.stage == 3:
            self.weights.copy_(self.master)                   # the next forward gathers it
        else:
            self.flat.full[self.flat.mine].copy_(self.master)
            comm.all_gather(self.flat.full, self.flat.full[self.flat.mine])  # in place
        return loss.item()

    def held(self):
        """Bytes this rank holds between steps, by category (storages counted once)."""
        seen = set()
        weights = [self.flat.full] + ([self.weights] if self.stage == 3 else [])
        out = {"parameters": memory.storage_bytes(weights, seen),
               "gradients": memory.storage_bytes([self.grad], seen),
               "optimizer_state": memory.storage_bytes([self.master, self.m, self.v], seen)}
        out["total"] = sum(out.values())
        return out


def param_bound(weights, steps, lr):
    """How far two runs of mixed-precision Adam can drift apart when their gradients differ only by
    bf16 rounding: Adam moves a weight by at most about lr per step whatever the gradient's size,
    so a flipped sign costs 2 lr, plus one bf16 spacing at the largest weight for the final cast."""
    return 2 * lr * steps + torch.finfo(torch.bfloat16).eps * weights.abs().max().item()


def formula_bytes(stage, padded, n):
    """Chapter 1's per-rank formulas, on the padded element count."""
    per_param = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]
    return per_param * padded


def formula_comm(stage, padded, n, zero1_allreduce=False):
    """Bytes each rank sends per step: (N-1)/N x {2, 2, 2, 3} x Psi x 2 bytes."""
    passes = 3 if stage == 3 or (stage == 1 and zero1_allreduce) else 2
    return passes * (n - 1) * padded * BF16 // n


def _batch(cfg, step, rank, batch_size, device):
    return tiny.synthetic_batch(cfg, batch_size, seed=10_000 * step + rank, device=device)


def single_process(cfg, steps, batch_size, world_size, lr=1e-3):
    """The reference: the same recipe on the whole global batch in one process.

    Returns the final weights and the first step's gradient, both flat.
    """
    dev = launch.device()
    net = tiny.build(cfg, seed=0, device=dev)
    opt = precision.prepare(net, "mixed", lr=lr)
    for step in range(steps):
        batches = [_batch(cfg, step, r, batch_size, dev) for r in range(world_size)]
        net(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
        if step == 0:
            first_grad = torch.cat([p.grad.float().view(-1) for p in net.parameters()])
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().float().view(-1) for p in net.parameters()]), first_grad


def run(rank, world_size, stage, steps=3, batch_size=2, zero1_allreduce=False, lr=1e-3):
    """Train with one stage; report bytes held, bytes sent per step, and the distance to one process."""
    cfg, dev = tiny.GPTConfig(), launch.device()
    z = ZeRO(tiny.build(cfg, seed=0, device=dev), stage, lr=lr, zero1_allreduce=zero1_allreduce)
    losses, sent, first_grad = [], [], []
    for step in range(steps):
        with comm.counting() as tally:
            losses.append(z.step(*_batch(cfg, step, rank, batch_size, dev), inspect=first_grad if step == 0 else None))
        sent.append(tally.bytes_sent)
    held = z.held()
    if stage == 3:
        z.flat.gather(z.weights)  # the full weights once more, outside the counted steps, to compare
    mine = z.flat.full[:z.flat.numel].float()
    reference, ref_grad = single_process(cfg, steps, batch_size, world_size, lr)
    ref_grad = torch.cat([ref_grad, ref_grad.new_zeros(z.flat.padded - z.flat.numel)])
    ref_grad = ref_grad if stage == 0 else ref_grad[z.flat.mine]
    # Adam ignores the gradient's scale, so the weights alone would not notice a missing 1/N:
    # the averaged gradient is compared too, relative to its largest entry.
    grad_error = ((first_grad[0] - ref_grad).abs().max() / ref_grad.abs().max()).item()
    return {"numel": z.flat.numel, "padded": z.flat.padded, "held": held,
            "comm_bytes_per_step": sent[-1], "losses": losses,
            "max_param_diff_vs_single_process": (mine - reference).abs().max().item(),
            "param_bound": param_bound(reference, steps, lr),
            "grad_rel_error_vs_single_process": grad_error,
            "params": mine}



def all_stages(rank, world_size, steps=2):
    """`run` for DDP, ZeRO-1 (both reductions), ZeRO-2 and ZeRO-3 in one job."""
    out = {str(stage): run(rank, world_size, stage, steps) for stage in STAGES}
    out["1-allreduce"] = run(rank, world_size, 1, steps, zero1_allreduce=True)
    return out


def fsdp2(rank, world_size, steps=3, batch_size=2, lr=1e-3, cpu_offload=False):
    """The same training with PyTorch's FSDP2 (``fully_shard``): losses and how each weight is split."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    cfg, dev = tiny.GPTConfig(), launch.device()
    # fp32 masters that start from the bf16-rounded weights, exactly as the hand recipe's do
    net = tiny.build(cfg, seed=0, device=dev).to(torch.bfloat16).float()
    mesh = init_device_mesh(dev.type, (world_size,))
    policy = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
                  offload_policy=CPUOffloadPolicy() if cpu_offload else None)
    policy = {k: v for k, v in policy.items() if v is not None}
    for block in net.blocks:  # one unit per block: gathered just before it runs, freed after
        fully_shard(block, **policy)
    fully_shard(net, **policy)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = net(*_batch(cfg, step, rank, batch_size, dev))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    shards = {name: {"placements": str(p.placements), "full_shape": tuple(p.shape),
                     "local_shape": tuple(p.to_local().shape), "device": str(p.to_local().device)}
              for name, p in net.named_parameters()}
    return {"losses": losses, "shards": shards,
            "local_numel": sum(p.to_local().numel() for p in net.parameters()),
            "numel": sum(p.numel() for p in net.parameters())}


# Chapter 3's exercises: the answers are computed here, so the book never types them.
EXERCISES = {
    "1": lambda: budget.state_gb("70B", 64, zero_stage=2),
    "2": lambda: formula_comm(3, budget.MODELS["13B"].params(), 8) / budget.GB,
}


def check(question, answer, rel=0.01):
    from labs import exercises
    return exercises.check(EXERCISES, question, answer, rel)


def main(argv=None):
    from labs import cli
    p = cli.parser("ZeRO by hand: bytes held and sent per rank, against the formulas and one process.")
    p.add_argument("--stage", type=int, choices=STAGES, default=3, help="0 = DDP, 1, 2 or 3")
    p.add_argument("--steps", type=cli.positive_int, default=3)
    p.add_argument("--zero1-allreduce", action="store_true",
                   help="stage 1 with an all-reduce of the gradients instead of a reduce-scatter")
    args = cli.parse(p, argv)
    results = launch.launch(run, args.world_size, args.stage, args.steps, zero1_allreduce=args.zero1_allreduce,
                            timeout=args.timeout)
    if results is None:
        return
    n, r0 = len(results), results[0]
    result = {"world_size": n, "stage": args.stage, "numel": r0["numel"], "padded": r0["padded"],
              "state_bytes": [r["held"]["total"] for r in results],
              "state_bytes_formula": formula_bytes(args.stage, r0["padded"], n),
              "comm_bytes_per_step": [r["comm_bytes_per_step"] for r in results],
              "comm_bytes_formula": formula_comm(args.stage, r0["padded"], n, args.zero1_allreduce),
              "max_param_diff_vs_single_process": max(r["max_param_diff_vs_single_process"] for r in results),
              "param_bound": r0["param_bound"],
              "grad_rel_error_vs_single_process": max(r["grad_rel_error_vs_single_process"] for r in results)}
    cli.report(result, args, f"ZeRO-{args.stage} on {n} ranks, Psi = {r0['numel']} (padded {r0['padded']}): "
               f"{result['state_bytes'][0] / r0['numel']:.3f} bytes/param held per rank (formula "
               f"{result['state_bytes_formula'] / r0['numel']:.3f}), {result['comm_bytes_per_step'][0]} bytes sent per "
               f"step (formula {result['comm_bytes_formula']}), max |w - one process| "
               f"{result['max_param_diff_vs_single_process']:.4f} (bound {r0['param_bound']:.4f})")


if __name__ == "__main__":
    from labs import cli
    cli.main(main)
