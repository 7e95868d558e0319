"""Chapter 13: less communication per step: gradient compression as DDP communication hooks.

DDP hands each gradient bucket to a communication hook, ``hook(state, bucket) -> Future``, whose
result it writes back as the averaged gradient (torch DDP, ``register_comm_hook``). Two hooks are
built here by hand, beside two of PyTorch's own, on the same DDP and the same data:

- top-k sparsification: each rank sends the k = ``ratio`` x n largest entries of its gradient
  (values and int32 indices, all-gathered: the ranks pick different entries), the rest is zero.
  With error feedback the entries not sent are kept and added to the next step's gradient, so
  nothing is lost, only delayed (Stich et al. 2018, "Sparsified SGD with memory"); without, the
  small entries are dropped every step.
- int8 quantization: one scale per bucket agreed by an all-reduce of the largest magnitude, each
  rank's gradient rounded to int8 and all-gathered (int8 sums would overflow), averaged in fp32.
- PyTorch's 16-bit hook (the bucket cast to 16 bits, all-reduced, cast back): ``bf16_compress_hook``
  on NCCL, ``fp16_compress_hook`` on gloo (DDP refuses the bf16 one in a build without CUDA and NCCL
  2.10, whatever the backend in use); and ``powerSGD_hook``
  (Vogels et al. 2019: each matrix approximated by a rank-r product P Q^T, with error feedback and warm start;
  1-D tensors all-reduced uncompressed), run twice: compressing from step 2, and from a tenth of the
  steps, where ``PowerSGDState``'s docstring suggests starting (later starts are not tried).

Two byte counts per step, each named: the payload of the hand hooks' messages (the tensors each
rank hands to its collectives, `labs.measure.comm`), and the library's wire bytes of the whole
backward pass, every hook's collectives included (`labs.measure.wire`, gloo's preambles counted).
Then the held-out loss after the same steps, against plain DDP.

    python -m labs.failures.compression --json
"""
import statistics

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from labs import model as tiny
from labs.failures import bigram
from labs.launcher import launch
from labs.measure import comm

METHODS = ("ddp", "half", "powersgd", "powersgd_late", "int8", "topk_ef", "topk")
LR, MOMENTUM = 0.02, 0.9


class TopK:
    """State of the top-k hook: the ratio kept, and with error feedback each bucket's residual."""

    def __init__(self, ratio, error_feedback):
        self.ratio, self.error_feedback, self.residual = ratio, error_feedback, {}


def _done(tensor):
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def topk_hook(state, bucket):
    g = bucket.buffer()                                           # (n,) this rank's flat gradients
    if state.error_feedback:
        g = g + state.residual.get(bucket.index(), torch.zeros_like(g))
    k = max(1, int(state.ratio * g.numel()))
    idx = g.abs().topk(k).indices                                 # (k,)
    vals = g[idx]
    if state.error_feedback:                                      # what was not sent waits for the next step
        state.residual[bucket.index()] = g.index_fill(0, idx, 0.0)
    n = dist.get_world_size()
    all_vals = torch.empty(n * k, dtype=g.dtype, device=g.device)
    all_idx = torch.empty(n * k, dtype=torch.int32, device=g.device)
    comm.all_gather(all_vals, vals)
    comm.all_gather(all_idx, idx.to(torch.int32))
    out = torch.zeros_like(g).index_add_(0, all_idx.long(), all_vals)
    return _done(out / n)


def int8_hook(state, bucket):
    g = bucket.buffer()                                           # (n,)
    scale = g.abs().max().reshape(1)
    comm.all_reduce(scale, op=dist.ReduceOp.MAX)                  # one scale for every rank
    scale = scale.clamp_min(torch.finfo(g.dtype).tiny)
    q = torch.round(g / scale * 127).to(torch.int8)               # (n,) one byte per entry
    n = dist.get_world_size()
    every = torch.empty(n * g.numel(), dtype=torch.int8, device=g.device)
    comm.all_gather(every, q)
    return _done(every.view(n, -1).float().sum(0) * (scale / 127) / n)


def wrap(method, model, ratio=0.01, rank=1, steps=40):
    """DDP around ``model`` with the method's communication hook (none for plain DDP).
    ``powersgd`` starts compressing at step 2, the earliest DDP allows with error feedback;
    ``powersgd_late`` after a tenth of the ``steps``, where ``PowerSGDState``'s docstring suggests
    starting."""
    ddp = DistributedDataParallel(model)
    if method == "half":   # bf16 needs a CUDA+NCCL 2.10 build (distributed.py, _check_comm_hook)
        nccl = dist.get_backend() == "nccl"
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook if nccl
                               else default_hooks.fp16_compress_hook)
    elif method in ("powersgd", "powersgd_late"):
        start = 2 if method == "powersgd" else max(2, steps // 10)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=start)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif method == "int8":
        ddp.register_comm_hook(None, int8_hook)
    elif method in ("topk", "topk_ef"):
        ddp.register_comm_hook(TopK(ratio, method == "topk_ef"), topk_hook)
    elif method != "ddp":
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}.")
    return ddp


def train(rank, world_size, methods, steps, ratio, powersgd_rank):
    """Every method in turn, from the same weights on the same batches; per method the held-out
    loss after each step and, per step, the payload and the wire bytes of backward (None on NCCL,
    whose traffic gloo's counter cannot see: `labs.measure.wire`)."""
    torch.set_num_threads(1)
    out, dev = {}, launch.device()
    for method in methods:
        ddp = wrap(method, tiny.build(bigram.CFG, seed=0, device=dev), ratio, powersgd_rank, steps)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        losses, wire_bytes, payload = [], [], []
        for s in range(steps):
            opt.zero_grad()
            x, y = (t.to(dev) for t in bigram.batch(s, rank))
            loss = ddp(x, y)
            with comm.counting() as tally, comm.wire_bytes() as w:
                loss.backward()                                   # the hook's collectives run in here
            opt.step()
            losses.append(bigram.held_out_loss(ddp.module))
            wire_bytes.append(w.bytes)
            payload.append(tally.payload_bytes)
        out[method] = {"losses": losses, "wire_bytes": wire_bytes, "payload_bytes": payload,
                       "wire_reason": w.reason, "params": sum(p.numel() for p in ddp.parameters())}
    return out


def compression(world_size=2, steps=40, ratio=0.01, powersgd_rank=1, methods=METHODS, timeout=300.0):
    """Train the tiny GPT ``steps`` steps with each method on ``world_size`` ranks; per method: wire
    bytes per step (median after the first two), the hand hooks' payload, the final held-out
    loss and its gap to plain DDP's."""
    if not 0 < ratio < 1:
        raise ValueError(f"--ratio {ratio}: the share of entries top-k keeps must lie in (0, 1).")
    if "ddp" not in methods:
        raise ValueError("the methods must include ddp: every gap is measured against it.")
    ranks = launch.spawn(train, world_size, tuple(methods), steps, ratio, powersgd_rank, timeout=timeout)
    r0, out = ranks[0], {}
    steady = lambda xs: statistics.median(xs[2:]) if None not in xs else None   # noqa: E731
    for m in methods:
        out[m] = {"wire_bytes_per_step": steady(r0[m]["wire_bytes"]),
                  "wire_bytes_by_rank": [steady(r[m]["wire_bytes"]) for r in ranks],
                  "payload_bytes_per_step": steady(r0[m]["payload_bytes"]) or None,
                  "final_loss": r0[m]["losses"][-1], "losses": r0[m]["losses"],
                  "replicas_agree": all(r[m]["losses"] == r0[m]["losses"] for r in ranks)}
    base = out["ddp"]
    for m in methods:
        w = out[m]["wire_bytes_per_step"]
        out[m]["wire_reduction"] = None if w is None else base["wire_bytes_per_step"] / w
        out[m]["loss_gap"] = (out[m]["final_loss"] - base["final_loss"]) / base["final_loss"]
    return {"methods": out, "world_size": world_size, "steps": steps, "ratio": ratio,
            "powersgd_rank": powersgd_rank, "params": r0["ddp"]["params"],
            "wire_reason": r0["ddp"]["wire_reason"]}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Gradient compression as DDP communication hooks: top-k (with and without error "
                   "feedback), int8, bf16 and PowerSGD against plain DDP.", world_size_default=2)
    p.add_argument("--steps", type=cli.at_most(500, "a short run"), default=40)
    p.add_argument("--ratio", type=float, default=0.01, help="share of entries top-k sends (default 0.01)")
    args = cli.parse(p, argv)
    r = compression(args.world_size, args.steps, args.ratio, timeout=args.timeout)
    rows = "; ".join(f"{m}: {v['wire_reduction']:.1f}x fewer wire bytes, loss {100 * v['loss_gap']:+.1f} %"
                     for m, v in r["methods"].items() if v["wire_reduction"])
    cli.report(r, args, rows)


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
