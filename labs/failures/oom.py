"""Chapter 13: out of memory partway through training, and the resume with another setting.

A run that has trained for hours meets a batch longer than any before it, and the backward pass
asks for more memory than the device has. The lab makes that happen on purpose: two ranks train
the tiny GPT with data parallelism and gradient accumulation, under a memory limit the lab sets
(`MemoryLimit`: chapter 1's live-storage accounting, `labs.measure.memory.PeakMemory`, raising
``torch.OutOfMemoryError`` as the CUDA allocator would, when the bytes live at once would pass the
limit). At step ``long_at`` rank 1's batch has sequences twice as long: attention's (B, a, T, T)
activations grow four times, and the limit is passed in the backward pass. The launcher names
rank 1 and the error, rank 0's all-reduce fails as soon as rank 1's socket closes (nobody hangs),
and the run resumes from its latest checkpoint with either setting that lowers the peak:

- recomputation of every block (`torch.utils.checkpoint`): the same operations in the same order,
  so the losses equal an uninterrupted run's bit for bit;
- micro-batches half as large (twice as many): the same gradient summed in another order, so the
  losses stay within chapter 12's bound for a changed micro-batch split
  (`labs.checkpointing.resharding.LOSS_TOL`), not bit for bit.

    python -m labs.failures.oom --json
"""
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from labs import model as tiny
from labs.launcher import launch
from labs.measure import memory
from labs.checkpointing import resharding
from labs.failures import fault_training
from labs.recompute.pipeline_memory import Checkpointed

CFG = tiny.GPTConfig()
SEQ, LONG_SEQ = 8, 16       # tokens per sequence: every step, and rank 1's long batch
BATCH, LR = 8, 0.05         # sequences per rank per step


class MemoryLimit(memory.PeakMemory):
    """`PeakMemory` that raises ``torch.OutOfMemoryError`` when the live bytes would pass ``limit``
    (the message says how much was asked for, as CUDA's allocator does). Records the phase."""

    def __init__(self, limit, *external):
        super().__init__(*external)
        self.limit, self.phase, self.forward_peak = limit, "forward", 0

    def _change(self, delta):
        super()._change(delta)
        if self.phase == "forward":
            self.forward_peak = max(self.forward_peak, self.baseline_bytes + self.net)
        if delta > 0 and self.baseline_bytes + self.net > self.limit:
            raise torch.OutOfMemoryError(
                f"tried to allocate {delta:,} bytes in {self.phase} ({self._op}); "
                f"{self.baseline_bytes + self.net:,} bytes would be live, the limit is {self.limit:,}")


def batch(step, rank, long_at):
    T = LONG_SEQ if (step == long_at and rank == 1) else SEQ
    return tiny.synthetic_batch(CFG, BATCH, seed=1000 * step + rank, seq_len=T)


def build(recompute):
    model = tiny.build(CFG, seed=0)
    if recompute:
        model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in model.blocks)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def step(model, opt, x, y, micro, world_size, limit=None):
    """One step: ``BATCH / micro`` micro-batches accumulated, one all-reduce of the flat gradient."""
    opt.zero_grad()
    guard = MemoryLimit(limit or float("inf"), model, opt)
    loss = torch.zeros(())
    with guard:
        for i in range(0, BATCH, micro):
            guard.phase = "forward"
            part = model(x[i:i + micro], y[i:i + micro]) * (micro / BATCH)   # mean over the batch
            guard.phase = "backward"
            part.backward()
            loss += part.detach()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])   # (P,)
    fault_training.apply(model, opt, fault_training.average(flat, world_size))
    dist.all_reduce(loss)
    return (loss / world_size).item(), (guard.forward_peak, guard.peak_bytes)


@launch.on_cpu("the out-of-memory is the lab's own limit on chapter 1's count of live storages, not a "
               "device allocator's; on the CPU the resume with recomputation is compared bit for bit")
def train(rank, world_size, folder, steps, every, micro, recompute, limit, long_at):
    """Resume from the latest checkpoint in ``folder`` (if any), train to ``steps``, checkpoint every
    ``every`` steps (rank 0: the model is replicated). Returns the losses and each step's peak."""
    model, opt = build(recompute)
    names = sorted(n for n in os.listdir(folder) if n.endswith(".pt"))
    start = 0
    if names:
        snap = torch.load(os.path.join(folder, names[-1]))
        inner = {k.replace(".block.", "."): v for k, v in snap["model"].items()}
        model.load_state_dict({k: inner[k.replace(".block.", ".")] for k in model.state_dict()})
        opt.load_state_dict(snap["optim"])
        start = snap["step"]
    out = {"start": start, "losses": {}, "peaks": {}}
    for s in range(start, steps):
        x, y = batch(s, rank, long_at)
        out["losses"][s], out["peaks"][s] = step(model, opt, x, y, micro, world_size, limit)
        if rank == 0 and (s + 1) % every == 0:
            plain = {k.replace(".block.", "."): v for k, v in model.state_dict().items()}
            torch.save({"model": plain, "optim": opt.state_dict(), "step": s + 1},
                       os.path.join(folder, f"step{s + 1:04d}.pt"))
        dist.barrier()   # the checkpoint is on disk before any rank moves on
    return out


def oom(steps=8, every=3, long_at=5, micro=4, limit=None, world_size=2, timeout=120.0):
    """The run without a limit (the reference), the limit from its peaks, the run that goes out of
    memory, and the two resumes. ``limit`` defaults to midway between the long step's peak in its
    forward passes and its peak in all, both measured in the reference run: above every normal
    step's peak, passed only in the long step's backward."""
    if not 0 < every < long_at < steps or long_at % every == 0:
        raise ValueError(f"--long-at {long_at} must come after a checkpoint (--every {every}), not on one, "
                         f"and before --steps {steps}.")
    if BATCH % micro or micro % 2:
        raise ValueError(f"--micro {micro} must divide the batch of {BATCH} and be even (it is halved).")
    roots = [tempfile.mkdtemp(prefix="labs-oom-") for _ in range(3)]
    try:
        ref = launch.spawn(train, world_size, roots[0], steps, every, micro, False, None, long_at,
                           timeout=timeout)
        normal = max(p[1] for r in ref for s, p in r["peaks"].items() if s != long_at)
        forward, longest = (max(r["peaks"][long_at][i] for r in ref) for i in (0, 1))
        if not normal < forward < longest:
            raise RuntimeError(f"the long batch's peaks ({forward:,} in forward, {longest:,} in all) do "
                               f"not bracket a normal step's {normal:,}: no limit fails it in backward only")
        limit = limit or (forward + longest) // 2   # passed in backward, never in forward
        try:
            launch.spawn(train, world_size, roots[1], steps, every, micro, False, limit, long_at,
                         timeout=timeout)
            error = None
        except launch.RankError as exc:
            error = exc
        shutil.copytree(roots[1], roots[2], dirs_exist_ok=True)   # the same checkpoints for both resumes
        resumed = {"recompute": launch.spawn(train, world_size, roots[1], steps, every, micro, True,
                                             limit, long_at, timeout=timeout),
                   "half_micro": launch.spawn(train, world_size, roots[2], steps, every, micro // 2,
                                              False, limit, long_at, timeout=timeout)}
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    losses = ref[0]["losses"]
    out = {"limit": limit, "normal_peak": normal, "long_forward_peak": forward, "long_peak": longest,
           "reference_losses": losses,
           "failed_rank": None if error is None else error.rank,
           "error": None if error is None else str(error).splitlines()[0],
           # a failure, not a timeout: rank 0's all-reduce failed when rank 1's socket closed
           "timed_out": isinstance(error, launch.RankTimeout),
           "peers": None if error is None else str(error).splitlines()[1]}
    for how, r in resumed.items():
        start = r[0]["start"]
        tail = [r[0]["losses"][s] for s in range(start, steps)]
        out[how] = {"resumed_from": start, "losses": tail,
                    "peak": max(p[1] for x in r for p in x["peaks"].values()),
                    "bit_exact": tail == [losses[s] for s in range(start, steps)],
                    "max_loss_diff": max(abs(a - losses[s]) for a, s in zip(tail, range(start, steps)))}
    out["loss_tol"] = resharding.LOSS_TOL
    return out


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Two ranks train under a memory limit; a long batch goes out of memory in backward on "
                   "rank 1; the run resumes with recomputation, or with smaller micro-batches.",
                   world_size_default=2)
    p.add_argument("--steps", type=cli.at_most(50, "a short run"), default=8)
    p.add_argument("--long-at", type=cli.positive_int, default=5, help="the step of rank 1's long batch")
    args = cli.parse(p, argv)
    if args.world_size != 2:
        raise ValueError(f"--world-size {args.world_size}: the lab runs 2 ranks (rank 1 goes out of memory).")
    r = oom(args.steps, long_at=args.long_at, timeout=args.timeout)
    cli.report(r, args, f"limit {r['limit']:,} bytes: {r['error']}; resumed with recomputation: bit for bit "
               f"{r['recompute']['bit_exact']}; with half the micro-batch: within {r['loss_tol']:g}: "
               f"{r['half_micro']['max_loss_diff'] < r['loss_tol']}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
