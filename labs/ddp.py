"""Chapter 2: data parallelism built by hand, beside torch's DistributedDataParallel.

Every rank holds the whole model and its own slice of the batch. After backward the gradients
are averaged with one all-reduce, so every replica takes the same step (Li et al. 2020, "PyTorch
Distributed", arXiv 2006.15704). Two refinements make it fast:
- buckets: gradients are packed into a few flat buffers, one all-reduce each, since many small
  messages pay the latency term alpha many times;
- overlap: backward produces the last layers' gradients first, so a bucket whose gradients are
  all ready starts its all-reduce while backward is still computing the earlier layers.
`no_sync` skips the all-reduce for the micro-batches of gradient accumulation.

    python -m labs.ddp --world-size 2 --steps 3 --json
"""
import contextlib
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from labs import comm, launch, model as tiny


class Bucket:
    def __init__(self, params):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.reset()

    def reset(self):
        self.ready, self.work, self.times = 0, None, {}


class HandDDP:
    """Bucketed, overlapped gradient all-reduce through hooks; call `finish` after backward."""

    def __init__(self, model, bucket_cap_bytes=25 * 2**20):
        self.model = model
        self.world_size = dist.get_world_size()
        self.sync = True
        with torch.no_grad():  # replicas must start equal: everyone takes rank 0's weights
            for p in model.parameters():
                comm.broadcast(p.data, src=0)
        self.buckets = self._make_buckets([p for p in model.parameters() if p.requires_grad], bucket_cap_bytes)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    @staticmethod
    def _make_buckets(params, cap):
        """Fill buckets in reverse registration order, the order backward produces gradients."""
        buckets, current, size = [], [], 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                buckets.append(Bucket(current))
                current, size = [], 0
        if current:
            buckets.append(Bucket(current))
        return buckets

    def _grad_ready(self, p):
        if not self.sync:
            return  # no_sync: let .grad accumulate locally
        b = self.bucket_of[p]
        b.ready += 1
        if b.ready == len(b.params):
            self._launch(b)

    def _launch(self, b):
        b.times["ready"] = time.perf_counter()
        torch.cat([p.grad.view(-1) for p in b.params], out=b.buffer)
        b.work = comm.all_reduce(b.buffer, async_op=True)
        b.times["start"] = time.perf_counter()
        # The future completes on the communication thread: the true end of the all-reduce,
        # not the moment the training loop gets round to waiting for it.
        b.work.get_future().then(lambda fut, b=b: b.times.__setitem__("done", time.perf_counter()))

    def finish(self):
        """Wait for what is still in flight, then average and copy back into ``.grad``."""
        for b in self.buckets:
            if b.work is None:  # e.g. a parameter that got no gradient this step
                for p in b.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                self._launch(b)
            b.work.wait()
            b.buffer.div_(self.world_size)
            offset = 0
            for p in b.params:
                p.grad.copy_(b.buffer[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        timeline = [dict(b.times, bytes=b.buffer.numel() * b.buffer.element_size()) for b in self.buckets]
        for b in self.buckets:
            b.reset()
        return timeline

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


def overlap_fraction(timeline, backward_end):
    """Share of all-reduce time spent while backward was still running."""
    total = sum(t["done"] - t["start"] for t in timeline)
    hidden = sum(max(0.0, min(t["done"], backward_end) - t["start"]) for t in timeline)
    return hidden / total if total > 0 else 0.0


def _batch(cfg, step, micro, rank, batch_size, device):
    return tiny.synthetic_batch(cfg, batch_size, seed=10_000 * step + 100 * micro + rank, device=device)


def _train(net, wrapper, no_sync, cfg, steps, accumulation, batch_size, lr):
    """SGD with gradient accumulation; ``no_sync`` is the wrapper's or a no-op context."""
    rank, dev = dist.get_rank(), launch.device()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for step in range(steps):
        for micro in range(accumulation):
            x, y = _batch(cfg, step, micro, rank, batch_size, dev)
            sync_now = micro == accumulation - 1 or no_sync is None
            with contextlib.nullcontext() if sync_now else no_sync():
                (wrapper(x, y) / accumulation).backward()
            if sync_now and hasattr(wrapper, "finish"):  # the hand DDP waits here; torch's already did
                # Averaging an accumulated .grad is exact: the part from earlier synced
                # micro-batches is already identical on every rank.
                wrapper.finish()
        opt.step()
        opt.zero_grad()


def _single_process(cfg, steps, accumulation, batch_size, lr, world_size):
    """The reference: one process, the whole global batch, the same SGD."""
    dev = launch.device()
    net = tiny.build(cfg, seed=0, device=dev)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for step in range(steps):
        batches = [_batch(cfg, step, m, r, batch_size, dev) for m in range(accumulation) for r in range(world_size)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        net(x, y).backward()
        opt.step()
        opt.zero_grad()
    return net


class _Forward:
    """Lets a plain module and HandDDP share one training loop (HandDDP does not wrap forward)."""

    def __init__(self, ddp):
        self.ddp, self.finish = ddp, ddp.finish

    def __call__(self, x, y):
        return self.ddp.model(x, y)


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def run(rank, world_size, steps=3, accumulation=1, batch_size=2, lr=0.1, bucket_cap_bytes=16_384,
        use_no_sync=True):
    """Hand DDP, torch DDP and one process on the full batch: same parameters after ``steps``."""
    cfg, dev = tiny.GPTConfig(), launch.device()
    hand = tiny.build(cfg, seed=0, device=dev)
    ddp = HandDDP(hand, bucket_cap_bytes)
    with comm.counting() as tally:
        _train(hand, _Forward(ddp), ddp.no_sync if use_no_sync else None, cfg, steps, accumulation, batch_size, lr)
    ref = DistributedDataParallel(tiny.build(cfg, seed=0, device=dev))
    _train(ref.module, ref, ref.no_sync if use_no_sync else None, cfg, steps, accumulation, batch_size, lr)
    single = _single_process(cfg, steps, accumulation, batch_size, lr, world_size)
    return {"max_param_diff_vs_torch_ddp": _max_diff(hand, ref.module),
            "max_param_diff_vs_single_process": _max_diff(hand, single),
            "allreduce_calls": tally.calls("all_reduce"), "buckets": len(ddp.buckets),
            "allreduce_bytes": tally.ops["all_reduce"]["bytes_sent"] if tally.calls("all_reduce") else 0}


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


def timeline(rank, world_size, steps=3, bucket_cap_bytes=1 << 20, batch_size=8):
    """Per-bucket ready/start/done times of the last step, relative to the start of backward."""
    cfg, dev = tiny.GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, hidden=128), launch.device()
    net = tiny.build(cfg, seed=0, device=dev)
    ddp = HandDDP(net, bucket_cap_bytes)
    for step in range(steps):  # the first steps warm up allocator and connections
        x, y = _batch(cfg, step, 0, rank, batch_size, dev)
        loss = net(x, y)
        dist.barrier()
        t0 = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        events = ddp.finish()
        step_end = time.perf_counter()
        net.zero_grad()
    shift = [{k: (v - t0 if k != "bytes" else v) for k, v in e.items()} for e in events]
    return {"buckets": shift, "backward_end": backward_end - t0, "finish_end": step_end - t0,
            "overlap_fraction": overlap_fraction(events, backward_end), "params": tiny.num_params(net)}


def main(argv=None):
    from labs import cli
    p = cli.parser("Data parallel by hand: same parameters as torch DDP and as one process.")
    p.add_argument("--steps", type=cli.positive_int, default=3)
    p.add_argument("--accumulation", type=cli.positive_int, default=1, help="micro-batches per step (no_sync)")
    p.add_argument("--bucket-cap-bytes", type=cli.positive_int, default=16_384)
    args = cli.parse(p, argv)
    results = launch.launch(run, args.world_size, args.steps, args.accumulation,
                            bucket_cap_bytes=args.bucket_cap_bytes, timeout=args.timeout)
    if results is None:
        return
    result = {"world_size": len(results), "steps": args.steps, "accumulation": args.accumulation,
              "max_param_diff_vs_torch_ddp": max(r["max_param_diff_vs_torch_ddp"] for r in results),
              "max_param_diff_vs_single_process": max(r["max_param_diff_vs_single_process"] for r in results),
              "allreduce_calls": results[0]["allreduce_calls"], "buckets": results[0]["buckets"]}
    cli.report(result, args, f"{result['world_size']} ranks, {args.steps} steps x {args.accumulation} micro-batches: "
               f"max |hand - torch DDP| = {result['max_param_diff_vs_torch_ddp']:.2e}, max |hand - one process| = "
               f"{result['max_param_diff_vs_single_process']:.2e}, {result['allreduce_calls']} all-reduces "
               f"({result['buckets']} buckets)")


if __name__ == "__main__":
    from labs import cli
    cli.main(main)
