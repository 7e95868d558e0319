"""Chapter 9: recomputation under pipeline parallelism, on chapter 5's executor.

Under 1F1B (PipeDream-Flush; Narayanan et al. 2021, section 2.2) stage s of p runs p - s forwards
before its first backward, so it holds the activations of up to p - s micro-batches at once, each
of L/p layers: stage 0 holds p micro-batches of L/p layers, L layers' worth whatever p is. A
recomputation policy multiplies what each micro-batch leaves behind, so the two multiply:

    held by stage s = (p - s) micro-batches x (activation bytes of one micro-batch on stage s under the
    policy)

`run_policy` runs 1F1B on chapter 5's executor (`labs.pipeline.executor`, real sends and receives,
held bytes measured after every action by saved-tensor hooks) with every block of every stage
checkpointed or not, and measures one micro-batch's bytes per stage with the same hooks: the
product must hold exactly. The transient working set of a recomputed block inside a backward is
not in these numbers (they are taken between actions); chapter 9's notebook measures it as a peak.

    python -m labs.recompute.pipeline_memory --world-size 3 --json
"""
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from labs import model as tiny
from labs.launcher import launch
from labs.formulas import schedules
from labs.pipeline import executor, split_backward

PP_POLICIES = ("none", "full")


class Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint``: keeps its input, reruns its forward in backward."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def _pieces(cfg, p, policy):
    net = tiny.build(cfg, seed=0)
    pieces = executor.split(net, p)
    if policy == "full":
        for piece in pieces:   # applied from outside, after the split; the global names are kept
            piece.blocks = nn.ModuleList(Checkpointed(b) for b in piece.blocks)
    return pieces


def _one_micro_batch_bytes(piece, batch, hidden):
    """What one micro-batch's forward leaves on this stage for its backward, measured by the hooks
    the executor uses (`split_backward.Activations`). Not `executor.measure_pieces`: that one runs
    the forward under the split backward's deferral, which a checkpoint's recomputation outside it
    would not reproduce."""
    x, y = batch
    if not piece.first:   # a received activation is a leaf that needs its gradient
        x = torch.randn(*x.shape, hidden, requires_grad=True)
    acts = split_backward.Activations([piece])
    with acts.saving():
        out = piece(x, y)
    held = acts.held_bytes()
    torch.autograd.backward(out, None if piece.last else torch.randn_like(out))
    piece.zero_grad(set_to_none=True)
    return held


@launch.on_cpu("chapter 5's executor, a CPU emulation of pipeline timing")
def _run(rank, world_size, m, layers_per_stage, batch):
    p = world_size
    cfg = tiny.GPTConfig(n_layer=p * layers_per_stage)
    data = executor.microbatches(cfg, m, batch)
    ref = executor.reference_grads(cfg, data)
    actions = schedules.build("1f1b", p, m)[rank]
    out = {}
    for policy in PP_POLICIES:
        mine = [_pieces(cfg, p, policy)[rank]]
        one = _one_micro_batch_bytes(mine[0], data[0], cfg.hidden)
        ex = executor.Executor(mine, rank, p, 1, schedules.costs("1f1b", 1), 0.0, data, m, cfg.hidden)
        torch.distributed.barrier()
        ex.run(actions)
        err = max((q.grad - ref[n]).abs().max().item() for n, q in mine[0].named)
        out[policy] = {"held_peak_bytes": ex.peak_bytes, "in_flight_peak": ex.peak,
                       "one_micro_batch_bytes": one, "max_abs_error_grad": err}
    return out


def run_policy(world_size=3, m=6, layers_per_stage=2, batch=2, timeout=180.0):
    """1F1B on ``world_size`` stages, ``m`` micro-batches, with and without full recomputation. Per
    policy and stage: the measured peak of held activation bytes, the most micro-batches in flight,
    one micro-batch's bytes on that stage, and the largest gradient error against one process."""
    if m < world_size:
        raise ValueError(f"m={m} micro-batches cannot fill {world_size} stages; use m >= p.")
    stages = launch.spawn(_run, world_size, m, layers_per_stage, batch, timeout=timeout)
    return {"p": world_size, "m": m, "layers": world_size * layers_per_stage,
            "policies": {pol: [s[pol] for s in stages] for pol in PP_POLICIES}}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Recomputation under 1F1B: activation bytes held per stage, measured.",
                   world_size_default=3)
    p.add_argument("--microbatches", type=cli.at_most(64, "micro-batches"), default=6)
    args = cli.parse(p, argv)
    r = run_policy(args.world_size or 3, args.microbatches, timeout=args.timeout)
    cli.report(r, args, "\n".join(f"{pol}: held per stage {[s['held_peak_bytes'] for s in v]} B, in flight "
                                  f"{[s['in_flight_peak'] for s in v]}" for pol, v in r["policies"].items()))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
