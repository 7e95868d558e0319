"""Chapter 2: the hand DDP (`labs.data_parallel.hand_ddp`) beside torch's DistributedDataParallel.

`run`: hand DDP, torch DDP and one process on the full batch end with the same parameters, and
the hand DDP's all-reduce bytes are reported by kind (formula, wire, payload; counted through
`hand_ring` with ``counted=True``). `semantics`: the same as torch DDP on a model with a frozen
layer, a branch some ranks skip and a bf16 head, two backward() calls per step. `drift`: the
replicas drift apart while the all-reduce is off. `overlap_on_off`: whether the all-reduces run
while backward computes (checked from the order of events), and the time of each side.

    python -m labs.data_parallel.ddp --world-size 2 --steps 3 --json
"""
import contextlib
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from labs.measure import comm, timing, wire
from labs.data_parallel import hand_ring
from labs.data_parallel.hand_ddp import HandDDP, exposed_comm
from labs.launcher import launch
from labs import model as tiny


def _batch(cfg, step, micro, rank, batch_size, device):
    return tiny.synthetic_batch(cfg, batch_size, seed=10_000 * step + 100 * micro + rank, device=device)


def _train(wrapper, opt, no_sync, cfg, steps, accumulation, batch_size):
    """SGD with gradient accumulation; ``no_sync`` is the wrapper's or a no-op context."""
    rank, dev = dist.get_rank(), launch.device()
    for step in range(steps):
        for micro in range(accumulation):
            x, y = _batch(cfg, step, micro, rank, batch_size, dev)
            sync_now = micro == accumulation - 1 or no_sync is None
            with contextlib.nullcontext() if sync_now else no_sync():
                (wrapper(x, y) / accumulation).backward()
            # Averaging an accumulated .grad is exact: the part from earlier synced
            # micro-batches is already identical on every rank.
            if sync_now and hasattr(wrapper, "finish"):
                wrapper.finish()
        opt.step()
        opt.zero_grad()


def _single_process(cfg, steps, accumulation, batch_size, lr, world_size):
    """The reference: one process, the whole global batch, the same SGD."""
    dev = launch.device()
    net = tiny.build(cfg, seed=0, device=dev)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for step in range(steps):
        batches = [_batch(cfg, step, m, r, batch_size, dev) for m in range(accumulation)
                   for r in range(world_size)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        net(x, y).backward()
        opt.step()
        opt.zero_grad()
    return net


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def run(rank, world_size, steps=3, accumulation=1, batch_size=2, lr=0.1, bucket_cap_bytes=16_384,
        use_no_sync=True, counted=False, seeds_differ=False):
    """Hand DDP, torch DDP and one process on the full batch: same parameters after ``steps``.

    The hand DDP's all-reduce bytes over all steps, one key per kind (`labs.measure.comm`):
    allreduce_formula_bytes (the ring formula for the library all-reduce), allreduce_wire_bytes
    (what gloo wrote to its sockets during the training loop, preambles included; None with
    wire_reason where it cannot be read), allreduce_payload_bytes (the buckets handed to the
    all-reduces); ``counted=True`` runs them as hand rings: allreduce_counted_bytes, message by message.
    ``seeds_differ=True`` builds rank r's replicas from seed r, so only the wrappers' broadcast of rank
    0's weights at construction makes them equal to the one process (built from seed 0).
    """
    cfg, dev = tiny.GPTConfig(), launch.device()
    seed = rank if seeds_differ else 0
    hand = tiny.build(cfg, seed=seed, device=dev)
    ddp = HandDDP(hand, bucket_cap_bytes)
    opt = torch.optim.SGD(hand.parameters(), lr=lr)  # outside the wire window: its first build writes 4 bytes
    rings = hand_ring.hand_collectives() if counted else contextlib.nullcontext()
    with wire.measure() as w, comm.counting() as tally, rings:
        _train(ddp, opt, ddp.no_sync if use_no_sync else None, cfg, steps, accumulation, batch_size)
    ref = DistributedDataParallel(tiny.build(cfg, seed=seed, device=dev))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    _train(ref, ref_opt, ref.no_sync if use_no_sync else None, cfg, steps, accumulation, batch_size)
    single = _single_process(cfg, steps, accumulation, batch_size, lr, world_size)
    ar = tally.ops["all_reduce"]
    return {"max_param_diff_vs_torch_ddp": _max_diff(hand, ref.module),
            "max_param_diff_vs_single_process": _max_diff(hand, single),
            "allreduce_calls": ar["calls"], "buckets": len(ddp.buckets),
            "allreduce_formula_bytes": ar["formula_bytes_sent"], "allreduce_counted_bytes": ar["bytes_sent"],
            "allreduce_payload_bytes": ar["payload_bytes"], "allreduce_payloads": ar["payloads"],
            "allreduce_wire_bytes": w.bytes, "wire_reason": w.reason}


class MixedNet(torch.nn.Module):
    """A frozen input layer, fp32 layers, a branch some steps leave without a gradient, and a head
    in ``head_dtype`` registered last, so backward's first bucket is of that dtype."""

    def __init__(self, head_dtype=torch.bfloat16):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.inp, self.branch, self.out = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 16),
                                           torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 4).to(head_dtype)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.inp(self.frozen(x)))
        y = self.out(h) + (self.branch(h) if use_branch else 0)
        return (self.head(torch.tanh(y).to(self.head.weight.dtype)).float() ** 2).mean()


def semantics(rank, world_size, head_dtype=torch.bfloat16, steps=3, lr=0.5):
    """HandDDP, torch DDP (find_unused_parameters=True) and one process on `MixedNet`, two backward()
    calls per step without no_sync; the branch is used by every rank in step 0, by rank 0 only in
    step 1, by none in step 2. Returns the largest parameter difference per dtype, the buckets'
    dtypes, and whether the frozen layer stayed as built with no gradient."""
    dev = launch.device()

    def data(step, micro, r):
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + r)
        return torch.randn(4, 8, generator=g).to(dev)

    def used(step, r):
        return step == 0 or (step == 1 and r == 0)
    hand_net, ref_net, single = (MixedNet(head_dtype).to(dev) for _ in range(3))
    hand = HandDDP(hand_net, bucket_cap_bytes=1 << 20)
    ref = DistributedDataParallel(ref_net, find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (hand_net, ref_net, single)]
    for step in range(steps):
        for micro in range(2):  # two backward() calls before the optimizer step: both must count
            hand(data(step, micro, rank), used(step, rank)).backward()
            ref(data(step, micro, rank), used(step, rank)).backward()
            for r in range(world_size):  # one process: every rank's micro-batch, the loss averaged over ranks
                (single(data(step, micro, r), used(step, r)) / world_size).backward()
        hand.finish()
        for opt in opts:
            opt.step()
            opt.zero_grad()

    def diff(other, dtype):
        return max([(p - q).abs().max().item() for p, q in zip(hand_net.parameters(), other.parameters())
                    if p.dtype == dtype and p.requires_grad], default=None)
    return {"fp32_vs_torch_ddp": diff(ref_net, torch.float32),
            "bf16_vs_torch_ddp": diff(ref_net, torch.bfloat16), "fp32_vs_single": diff(single, torch.float32),
            "bf16_vs_single": diff(single, torch.bfloat16),
            "bucket_dtypes": [str(b.buffer.dtype) for b in hand.buckets],
            "frozen_unchanged": torch.equal(hand_net.frozen.weight, MixedNet().frozen.weight.to(dev))
            and hand_net.frozen.weight.grad is None}


def replica_spread(net):
    """Largest difference between this replica's parameters and rank 0's, over all ranks."""
    mine = torch.cat([p.detach().view(-1) for p in net.parameters()])
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    spread = (mine - rank0).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


def drift(rank, world_size, steps_off=3, steps_on=3, batch_size=2, lr=0.1):
    """Train with the all-reduce switched off, then on again: how far apart are the replicas?"""
    cfg, dev = tiny.GPTConfig(), launch.device()
    net = tiny.build(cfg, seed=0, device=dev)
    ddp = HandDDP(net, bucket_cap_bytes=1 << 30)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    spread = [replica_spread(net)]
    for step in range(steps_off + steps_on):
        x, y = _batch(cfg, step, 0, rank, batch_size, dev)
        synced = step >= steps_off
        with contextlib.nullcontext() if synced else ddp.no_sync():
            net(x, y).backward()
        if synced:
            ddp.finish()
        opt.step()
        opt.zero_grad()
        spread.append(replica_spread(net))
    return {"spread": spread, "steps_off": steps_off}


def _timed_step(net, ddp, x, y):
    """One forward + backward with gradient sync; times relative to the start of backward."""
    loss = net(x, y)
    dist.barrier()
    t0 = timing.now()
    loss.backward()  # the hand DDP settles at the end of autograd, so .grad holds the averages here
    events, end = ddp.finish(), timing.now()
    net.zero_grad()
    shifted = [{k: (v - t0 if k in ("ready", "start", "done") else v) for k, v in e.items()} for e in events]
    backward_end = ddp.backward_end - t0
    return {"buckets": shifted, "backward_end": backward_end, "finish_end": end - t0,
            "exposed_comm": exposed_comm(shifted, backward_end)}


def held_to_end(buckets, backward_end):
    """How many buckets' all-reduces started at or after the end of autograd: with overlap on each
    bucket, the last to fill included, starts from the hook of its last gradient, before autograd's
    end-of-backward callback, so this is 0; with overlap off it is every bucket."""
    return sum(b["start"] >= backward_end for b in buckets)


def launched_early(buckets):
    """How many buckets were launched before the last one to fill became ready (its last gradient's
    hook ran): backward still had gradients to compute after their launch. Both stamps are taken in
    autograd's hooks, in turn on one thread, so the count follows the hooks' order, not timing: every
    bucket but the last to fill with overlap on, 0 with overlap off and with ``defer_launch``."""
    return sum(b["start"] < max(c["ready"] for c in buckets) for b in buckets)


def left_running(buckets):
    """How many buckets were launched early (`launched_early`) and still running when their launch
    handed control back to autograd (HandDDP's exact ``running`` flag): backward went on computing
    under them. 0 with overlap off, ``wait_in_hook`` or ``defer_launch`` (the named mistakes)."""
    return sum(b["running"] and b["start"] < max(c["ready"] for c in buckets) for b in buckets)


def overlapped_steps(per_rank, mode="on"):
    """Per step of ``mode``: whether `left_running` > 0 on some rank. Over both ranks, since the rank
    that issues an all-reduce second can see it finish at once; the first cannot before the second
    issues it."""
    return [any(k > 0 for k in ks) for ks in zip(*(r[mode]["left_running"] for r in per_rank))]


@launch.on_cpu("the hand DDP's bucket timeline is read on the host clock inside autograd hooks, which on a "
               "GPU would time launches")
def overlap_on_off(rank, world_size, steps=6, bucket_cap_bytes=1 << 20, batch_size=8, wait_in_hook=False,
                   defer_launch=False):
    """Overlap on vs off in one run (alternating steps): exposed communication and step time.

    A four-layer model (h = 128) in 1 MiB buckets. Per mode, medians over ``steps`` steps after two
    warm-up steps: step_s (backward start to averaged gradients), backward_s (autograd alone),
    exposed_comm_s (end of autograd to end of the last all-reduce); step_all_s, backward_all_s,
    exposed_all_s: each step's value, in order (step i on and step i off ran one after the other,
    which first alternating pair by pair: a pair for `labs.measure.intervals`). first_start_s: each
    step's earliest all-reduce start relative to the end of autograd. Per step, the structural
    counts `held_to_end`, `launched_early` and `left_running`, and done_after_backward, the buckets
    stamped done (an upper bound on the end: the stamp is a callback that needs the GIL) after
    autograd ended. timeline: the mode's last step, per bucket ready/start/done in seconds since
    backward started. ``wait_in_hook``, ``defer_launch``: the named mistakes (`HandDDP`).
    """
    cfg = tiny.GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, hidden=128)
    net = tiny.build(cfg, seed=0, device=launch.device())
    ddp = HandDDP(net, bucket_cap_bytes, wait_in_hook=wait_in_hook, defer_launch=defer_launch)
    runs = {True: [], False: []}
    for step in range(2 + 2 * steps):
        ddp.overlap = (step % 2 == 0) != ((step // 2) % 2 == 1)   # on, off; off, on; on, off ...
        r = _timed_step(net, ddp, *_batch(cfg, step, 0, rank, batch_size, launch.device()))
        if step >= 2:
            runs[ddp.overlap].append(r)
    out = {}
    for mode, rs in (("on", runs[True]), ("off", runs[False])):
        out[mode] = {"step_s": statistics.median(r["finish_end"] for r in rs),
                     "backward_s": statistics.median(r["backward_end"] for r in rs),
                     "exposed_comm_s": statistics.median(r["exposed_comm"] for r in rs),
                     "step_all_s": [r["finish_end"] for r in rs],
                     "backward_all_s": [r["backward_end"] for r in rs],
                     "exposed_all_s": [r["exposed_comm"] for r in rs],
                     "first_start_s": [min(b["start"] for b in r["buckets"]) - r["backward_end"] for r in rs],
                     "done_after_backward": [sum(b["done"] > r["backward_end"] for b in r["buckets"])
                                             for r in rs],
                     "held_to_end": [held_to_end(r["buckets"], r["backward_end"]) for r in rs],
                     "launched_early": [launched_early(r["buckets"]) for r in rs],
                     "left_running": [left_running(r["buckets"]) for r in rs],
                     "timeline": rs[-1]}
    return dict(out, buckets=len(ddp.buckets), params=tiny.num_params(net), bucket_cap_bytes=bucket_cap_bytes,
                step_ratio_off_over_on=out["off"]["step_s"] / out["on"]["step_s"])


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Data parallel by hand: same parameters as torch DDP and as one process.")
    p.add_argument("--steps", type=cli.positive_int, default=3)
    p.add_argument("--accumulation", type=cli.positive_int, default=1,
                   help="micro-batches per step (no_sync)")
    p.add_argument("--bucket-cap-bytes", type=cli.positive_int, default=16_384)
    args = cli.parse(p, argv)
    results = launch.launch(run, args.world_size, args.steps, args.accumulation,
                            bucket_cap_bytes=args.bucket_cap_bytes, timeout=args.timeout)
    if results is None:
        return
    result = {"world_size": len(results), "steps": args.steps, "accumulation": args.accumulation,
              "max_param_diff_vs_torch_ddp": max(r["max_param_diff_vs_torch_ddp"] for r in results),
              "max_param_diff_vs_single_process": max(r["max_param_diff_vs_single_process"] for r in results),
              "allreduce_calls": results[0]["allreduce_calls"], "buckets": results[0]["buckets"],
              "allreduce_formula_bytes": results[0]["allreduce_formula_bytes"],
              "allreduce_wire_bytes": [r["allreduce_wire_bytes"] for r in results],
              "wire_reason": results[0]["wire_reason"]}
    cli.report(result, args,
               f"{result['world_size']} ranks, {args.steps} steps x {args.accumulation} micro-batches: "
               f"max |hand - torch DDP| = {result['max_param_diff_vs_torch_ddp']:.2e}, max |hand - "
               f"one process| = {result['max_param_diff_vs_single_process']:.2e}, "
               f"{result['allreduce_calls']} all-reduces ({result['buckets']} buckets); rank 0's all-reduce "
               f"bytes: ring formula {result['allreduce_formula_bytes']}, wire "
               f"{result['allreduce_wire_bytes'][0]}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
