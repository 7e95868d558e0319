"""Chapter 3: the ZeRO lab: every stage on the tiny GPT, bytes held, peak and sent per rank.

ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054) removes data parallelism's redundancy by giving
each of N ranks a 1/N shard of what the mixed-precision recipe holds (chapter 1: 2 + 2 + 12 bytes
per parameter): stage 1 shards the optimizer state (4 + 12/N), stage 2 also the gradients
(2 + 14/N), stage 3 also the weights (16/N). Per optimizer step of one micro-batch each rank
sends, with the ring's (N-1)/N factor and Psi bf16 elements (2 bytes each):
- DDP (stage 0): all-reduce of the gradients, 2(N-1)/N * 2Psi bytes;
- ZeRO-1 and 2: reduce-scatter of the gradients + all-gather of the updated weights: the same;
- ZeRO-3: all-gather before forward, again before backward, reduce-scatter: 3(N-1)/N * 2Psi, 1.5x.
With A micro-batches per step, DDP and ZeRO-1 still reduce once, ZeRO-2 reduce-scatters A times ((A+1)/2 x
DDP), ZeRO-3 does all three A times (3A/2 x DDP): `accumulation`.

Stages 0-2 are `sharded_optimizer.ShardedOptimizer` around ``torch.optim.Adam``, stage 3 `fsdp.HandFSDP`:
this lab trains the tiny GPT under each and under FSDP2 (`run`, `all_stages`, `accumulation`, `fsdp2`),
held to the bound on how far two Adam runs can drift apart (`adam_drift.param_bound`). The hand stages
run every collective as chapter 2's ring of point-to-point messages: their bytes are counted messages.

    python -m labs.zero.stages --world-size 3 --stage 3 --steps 3 --json
"""
import contextlib
import dataclasses

import torch

from labs.measure import comm, memory
from labs.data_parallel import hand_ring
from labs.zero import adam_drift, fsdp
from labs.launcher import launch
from labs import model as tiny
from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.zero.sharded_optimizer import ShardedOptimizer, frees_each_bucket, unit_buckets  # noqa: F401
from labs.zero.held import held_bytes, reachable_bytes  # noqa: F401
from labs.zero.answers import EXERCISES, MISTAKES, check, formula_bytes, formula_comm  # noqa: F401

STAGES = (0, 1, 2, 3)
_REFERENCES = {}  # single_process's results, per process


def _batch(cfg, step, rank, batch_size, device):
    return tiny.synthetic_batch(cfg, batch_size, seed=10_000 * step + rank, device=device)


def build(stage, cfg, lr=1e-3, zero1_allreduce=False, units="blocks", device="cpu"):
    """The tiny GPT under one stage: (model, optimizer, HandFSDP or None). Stages 0-2: bf16 weights and
    ShardedOptimizer(torch.optim.Adam), a bucket per block and one for the rest; stage 3: fp32 shards,
    bf16 compute in HandFSDP, a unit per block and the root (``units="whole"``: one unit), Adam."""
    net = tiny.build(cfg, seed=0, device=device).to(torch.bfloat16)  # bf16-representable start
    if stage == 3:
        hand = fsdp.HandFSDP(net.float(), list(net.blocks) if units == "blocks" else [],
                             compute_dtype=torch.bfloat16)
        return net, torch.optim.Adam(net.parameters(), lr=lr), hand
    return net, ShardedOptimizer(net.parameters(), torch.optim.Adam, stage=stage, lr=lr,
                                 buckets=unit_buckets(net, net.blocks), zero1_allreduce=zero1_allreduce), None


def _shard_grads(net, opt):
    """(name, offset in the parameter's flat view, averaged gradient) for what this rank updates."""
    if isinstance(opt, ShardedOptimizer):
        names = {p: n for n, p in net.named_parameters()}
        return [(names[p], b.lo + first - b.start[p], g[first:last].clone())
                for b, g in zip(opt.buckets, opt.reduce_grads()) for p, _, first, last in b.pieces]
    return [(n, p.offset, p.grad.clone()) for n, p in net.named_parameters()
            if p.grad is not None and p.numel()]


def _grad_error(pieces, ref):
    """Max |averaged gradient - one process's| over this rank's pieces, relative to the largest."""
    err, scale = 0.0, max(g.abs().max().item() for g in ref.values())
    for name, offset, g in pieces:
        want = ref[name].reshape(-1)[offset:offset + g.numel()]
        want = torch.cat([want, want.new_zeros(g.numel() - want.numel())])  # the padding's gradient is 0
        err = max(err, (g.float() - want).abs().max().item())
    return err / scale


# correct runs reach 0.035 per tensor (bf16 rounding, 2 to 4 ranks); one missing its 1/N, about N - 1
TENSOR_GRAD_TOL = 0.1


def grad_error_per_tensor(pieces, ref):
    """The same comparison, each piece relative to its own tensor's largest gradient: a tensor whose
    gradients are small beside the model's largest (the norms' weights) is judged on its own scale, so a
    missing 1/N on it scores about N - 1 here while `_grad_error` sees a few percent of the largest."""
    err = 0.0
    for name, offset, g in pieces:
        want = ref[name].reshape(-1)[offset:offset + g.numel()]
        want = torch.cat([want, want.new_zeros(g.numel() - want.numel())])
        err = max(err, (g.float() - want).abs().max().item() / ref[name].abs().max().item())
    return err


def single_process(cfg, steps, batch_size, world_size, lr=1e-3):
    """The reference: the same recipe (bf16 compute, Adam on fp32 masters) on the whole batch in one
    process: the start and final bf16 weights (flat fp32, in order) and the first gradient by name."""
    key = (dataclasses.astuple(cfg), steps, batch_size, world_size, lr)
    if key not in _REFERENCES:
        _REFERENCES[key] = _single_process(cfg, steps, batch_size, world_size, lr)
    return _REFERENCES[key]


def _single_process(cfg, steps, batch_size, world_size, lr):
    dev = launch.device()
    net = tiny.build(cfg, seed=0, device=dev).to(torch.bfloat16)
    masters = [torch.nn.Parameter(p.detach().float()) for p in net.parameters()]
    start = torch.cat([m.detach().clone().view(-1) for m in masters])
    opt = torch.optim.Adam(masters, lr=lr)
    for step in range(steps):
        batches = [_batch(cfg, step, r, batch_size, dev) for r in range(world_size)]
        net(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
        with torch.no_grad():
            for p, m in zip(net.parameters(), masters):
                m.grad, p.grad = p.grad.float(), None
            if step == 0:
                first_grad = {n: m.grad.clone() for (n, _), m in zip(net.named_parameters(), masters)}
            opt.step()
            for p, m in zip(net.parameters(), masters):
                p.copy_(m)
    return start, torch.cat([p.detach().float().view(-1) for p in net.parameters()]), first_grad


COMM_KINDS = {"hand": "counted messages", "library": "formula bytes"}


def _collectives(kind):
    """"hand": every collective in the block is a ring of counted point-to-point messages (chapter 2);
    "library": torch.distributed's collectives, whose bytes `labs.measure.comm` gives as the formula's."""
    if kind not in COMM_KINDS:
        raise ValueError(f"collectives must be one of {', '.join(COMM_KINDS)}, got {kind!r}.")
    return hand_ring.hand_collectives() if kind == "hand" else contextlib.nullcontext()


def _bytes_sent(tally, kind):
    return tally.bytes_sent if kind == "hand" else tally.formula_bytes_sent


def _working_weights(net, hand, cfg):
    """The full bf16 weights forward uses, as one flat fp32 vector in the reference's order."""
    if hand is None:
        return torch.cat([p.detach().float().view(-1) for p in net.parameters()])
    full, names = hand.full_parameters(), [n for n, _ in tiny.GPT(cfg).named_parameters()]
    return torch.cat([full[n].to(torch.bfloat16).float().view(-1) for n in names])


def _train(net, opt, cfg, steps, rank, batch_size, dev, collectives, after_first_backward=None):
    """The loop every scheme shares. Returns the losses, and the last step's byte tally and peak memory,
    whose ``backward_peak_bytes`` is the peak before ``opt.step`` (its timeline cut there) and
    ``after_forward_bytes`` the bytes live when forward has returned the loss."""
    losses = []
    for step in range(steps):
        x, y = _batch(cfg, step, rank, batch_size, dev)
        window = memory.PeakMemory(net, opt, x, y, timeline=True) if step == steps - 1 else None
        with _collectives(collectives), comm.counting() as tally, window or contextlib.nullcontext():
            opt.zero_grad()
            loss = net(x, y)
            fwd = len(window.timeline) if window else 0
            loss.backward()
            if step == 0 and after_first_backward is not None:
                after_first_backward()
            cut = len(window.timeline) if window else 0
            opt.step()
        losses.append(loss.item())
    peak = window.result()
    tl = [0, *peak.pop("timeline")]  # net bytes after each operator; live at the end of forward beside
    peak.update(backward_peak_bytes=peak["baseline_bytes"] + max(tl[:cut + 1]),
                after_forward_bytes=peak["baseline_bytes"] + tl[fwd])
    peak["full_grad_live_bytes"] = getattr(opt, "full_grad_peak_bytes", None)  # ShardedOptimizer's count
    peak["grad_reductions"] = getattr(opt, "reductions", None)  # stage 2: live after each bucket's
    return losses, tally, peak


def run(rank, world_size, stage, steps=3, batch_size=2, zero1_allreduce=False, lr=1e-3, units="blocks",
        cfg=None, collectives="hand"):
    """Train with one stage; report bytes held between steps, the peak during the last step, bytes
    sent per step, and the distance to one process.

    Result: numel, padded (the sharded element count, padding included), held (`held_bytes`, with
    the module's buffers and `reachable_bytes` of the model, optimizer and HandFSDP beside it),
    peak (`memory.PeakMemory.result` over the last step: zero_grad, forward, backward, step; with
    ``backward_peak_bytes``, the peak before the step, stages 0-2's ``full_grad_live_bytes`` and
    stage 2's ``grad_reductions``, `ShardedOptimizer.reductions`),
    comm_bytes_per_step and comm_ops_per_step (the last step's, from `labs.measure.comm`), comm_kind (what
    those bytes are: with ``collectives="hand"`` every collective is a hand ring of point-to-point
    messages and the bytes are counted messages; with "library" they are the ring formula's bytes
    for each library call), losses, params (the bf16 weights after training),
    grad_rel_error_vs_single_process (the first step's averaged gradient of this rank's shard),
    max_param_diff_vs_single_process and param_bound (Adam's drift bound, `adam_drift.param_bound`),
    update_error_vs_single_process (`adam_drift.update_error`: 1 for a run that never updated),
    max_units_gathered (hand ZeRO-3's most units gathered at once; None for stages 0-2)."""
    cfg, dev = cfg or tiny.GPTConfig(), launch.device()
    net, opt, hand = build(stage, cfg, lr, zero1_allreduce, units, dev)
    first = []  # the first step's gradients, taken between backward and the optimizer step
    losses, tally, peak = _train(net, opt, cfg, steps, rank, batch_size, dev, collectives,
                                 after_first_backward=lambda: first.append(_shard_grads(net, opt)))
    held = held_bytes(net, opt)
    held.update(buffers=memory.storage_bytes(net.buffers()), reachable=reachable_bytes(net, opt, hand))
    params = _working_weights(net, hand, cfg)
    start, reference, ref_grad = single_process(cfg, steps, batch_size, world_size, lr)
    padded = sum(b.padded for b in (opt.buckets if hand is None else hand.units))
    return {"numel": tiny.num_params(tiny.GPT(cfg)), "padded": padded, "held": held, "peak": peak,
            "comm_bytes_per_step": _bytes_sent(tally, collectives), "comm_kind": COMM_KINDS[collectives],
            "comm_ops_per_step": tally.as_dict()["ops"], "losses": losses, "params": params,
            "max_param_diff_vs_single_process": (params - reference).abs().max().item(),
            "param_bound": adam_drift.param_bound(reference, steps, lr),  # a run that never updated passes it
            "update_error_vs_single_process": adam_drift.update_error(start, params, reference),
            "grad_rel_error_vs_single_process": _grad_error(first[0], ref_grad),
            "grad_rel_error_per_tensor": grad_error_per_tensor(first[0], ref_grad),
            # hand ZeRO-3: the most units holding full weights at once (None for stages 0-2)
            "max_units_gathered": None if hand is None else hand.max_units_gathered}


def all_stages(rank, world_size, steps=2, batch_size=2):
    """`run` for DDP ("0"), ZeRO-1 with a reduce-scatter ("1") and with an all-reduce ("1-allreduce"),
    ZeRO-2, ZeRO-3 by units ("3") and gathering the whole model at once ("3-whole"), in one job."""
    out = {str(stage): run(rank, world_size, stage, steps, batch_size) for stage in STAGES}
    out["1-allreduce"] = run(rank, world_size, 1, steps, batch_size, zero1_allreduce=True)
    out["3-whole"] = run(rank, world_size, 3, steps, batch_size, units="whole")
    return out


def fsdp2(rank, world_size, steps=3, batch_size=2, lr=1e-3, cpu_offload=False, cfg=None, collectives="hand",
          reshard_after_forward=None):
    """The same training with PyTorch's FSDP2 (``fully_shard`` per block, then the root, bf16
    compute and reduction): losses, how each weight is split, bytes held, the last step's peak and
    bytes sent. ``collectives="hand"`` gives FSDP2 the hand rings through its custom-collective
    hooks (`fsdp.fully_shard_units`): counted messages, and no collective on gloo's threads.
    ``reshard_after_forward=False`` keeps each block gathered from its forward to its backward."""
    cfg, dev = cfg or tiny.GPTConfig(), launch.device()
    # fp32 masters that start from the bf16-rounded weights, exactly as the hand recipe's do
    net = tiny.build(cfg, seed=0, device=dev).to(torch.bfloat16).float()
    mesh = device_mesh(ParallelDims(dp=world_size), dev.type)["dp"]
    fsdp.fully_shard_units(net, list(net.blocks), mesh, torch.bfloat16, cpu_offload,
                           hand_comm=collectives == "hand", reshard_after_forward=reshard_after_forward)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    losses, tally, peak = _train(net, opt, cfg, steps, rank, batch_size, dev, collectives)
    shards = {name: {"placements": str(p.placements), "full_shape": tuple(p.shape),
                     "local_shape": tuple(p.to_local().shape), "device": str(p.to_local().device)}
              for name, p in net.named_parameters()}
    return {"losses": losses, "shards": shards, "held": held_bytes(net, opt), "peak": peak,
            # FSDP2's own collectives bypass labs.measure.comm: with "library" there is nothing to count
            "comm_bytes_per_step": tally.bytes_sent if collectives == "hand" else None,
            "comm_kind": COMM_KINDS[collectives], "comm_ops_per_step": tally.as_dict()["ops"],
            "local_numel": sum(p.to_local().numel() for p in net.parameters()),
            "numel": sum(p.numel() for p in net.parameters())}


def fsdp2_and_kept(rank, world_size, steps=2, batch_size=1):
    """`fsdp2`, then in the same job the same FSDP2 told to keep each block gathered from its forward
    to its backward (``reshard_after_forward=False``): that run's peak under "kept_gathered"."""
    out = fsdp2(rank, world_size, steps, batch_size)
    out["kept_gathered"] = fsdp2(rank, world_size, steps, batch_size, reshard_after_forward=False)["peak"]
    return out


def freed_after_forward(peak, kept, blocks_bf16_bytes):
    """Whether an FSDP2 run (``peak``, `fsdp2`'s) freed each block's gathered weights after its forward:
    when forward returns it holds at least the blocks' bf16 bytes less than ``kept``, the same FSDP2
    with ``reshard_after_forward=False`` (`fsdp2_and_kept`). Its peak, in backward, where it holds the
    block it computes and the one it prefetches, barely tells the two apart on a two-block model."""
    return kept["after_forward_bytes"] - peak["after_forward_bytes"] >= blocks_bf16_bytes


def accumulation(rank, world_size, accum_steps=(1, 2, 4), batch_size=1, cfg=None, collectives="hand"):
    """Bytes each rank sends in one optimizer step that accumulates A micro-batches.

    DDP and ZeRO-1 reduce once per optimizer step (gradients accumulate locally, as under DDP's
    ``no_sync``); ZeRO-2 reduce-scatters every micro-batch; ZeRO-3 also gathers the weights twice
    every micro-batch. Result: {stage: {m: {"bytes_sent", "ops": {op: calls and bytes}}}}, keys as
    strings; the bytes are counted messages of the hand rings (``collectives="hand"``) or the
    formula bytes of the library's collectives ("library"), as in `run`."""
    cfg, dev, out = cfg or tiny.GPTConfig(), launch.device(), {}
    for stage in STAGES:
        out[str(stage)] = {}
        for a in accum_steps:
            net, opt, _ = build(stage, cfg, device=dev)
            with _collectives(collectives), comm.counting() as tally:
                opt.zero_grad()
                for micro in range(a):
                    x, y = _batch(cfg, micro, rank, batch_size, dev)
                    (net(x, y) / a).backward()
                opt.step()
            out[str(stage)][str(a)] = {"bytes_sent": _bytes_sent(tally, collectives),
                                       "ops": tally.as_dict()["ops"]}
    return out


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("ZeRO by hand: bytes held, peak and sent per rank, against the formulas and one process.")
    p.add_argument("--stage", type=int, choices=STAGES, default=3, help="0 = DDP, 1, 2 or 3")
    p.add_argument("--steps", type=cli.positive_int, default=3)
    p.add_argument("--zero1-allreduce", action="store_true",
                   help="stage 1 with an all-reduce of the gradients instead of a reduce-scatter")
    p.add_argument("--whole", action="store_true", help="stage 3 gathering the whole model at once")
    args = cli.parse(p, argv)
    results = launch.launch(run, args.world_size, args.stage, args.steps, timeout=args.timeout,
                            zero1_allreduce=args.zero1_allreduce, units="whole" if args.whole else "blocks")
    if results is None:
        return
    n, r0 = len(results), results[0]
    result = {"world_size": n, "stage": args.stage, "numel": r0["numel"], "padded": r0["padded"],
              "state_bytes": [r["held"]["total"] for r in results],
              "state_bytes_formula": formula_bytes(args.stage, r0["padded"], n),
              "peak_bytes": [r["peak"]["peak_bytes"] for r in results], "param_bound": r0["param_bound"],
              "comm_bytes_per_step": [r["comm_bytes_per_step"] for r in results],
              "comm_bytes_formula": formula_comm(args.stage, r0["padded"], n, args.zero1_allreduce),
              "max_param_diff_vs_single_process": max(r["max_param_diff_vs_single_process"] for r in results),
              "grad_rel_error_vs_single_process": max(r["grad_rel_error_vs_single_process"] for r in results)}
    cli.report(result, args, f"ZeRO-{args.stage} on {n} ranks, Psi = {r0['numel']} (padded {r0['padded']}): "
               f"{result['state_bytes'][0] / r0['numel']:.3f} bytes/param held per rank (formula "
               f"{result['state_bytes_formula'] / r0['numel']:.3f}), peak during a step "
               f"{result['peak_bytes'][0]} bytes, {result['comm_bytes_per_step'][0]} bytes sent per step "
               f"({r0['comm_kind']}; formula {result['comm_bytes_formula']}), max |w - one process| "
               f"{result['max_param_diff_vs_single_process']:.4f} (bound {r0['param_bound']:.4f})")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
