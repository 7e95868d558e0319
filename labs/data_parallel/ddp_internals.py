"""Chapter 2: four things of torch's DistributedDataParallel that a user meets (Li et al. 2020).

Li et al. 2020 ("PyTorch Distributed", arXiv 2006.15704, §3.2-3.3) for the design; the details
below that the paper does not have are torch 2.13's, read in its source (`torch/nn/parallel/
distributed.py`: `_BucketCapacityConfig.compute_bucket_size_limits`, `_post_forward`; the bucket
assignment `dist._compute_bucket_assignment_by_size`, which never puts two dtypes in one bucket):
1. **Bucket order.** The paper fills buckets in reverse registration order, a guess at the
   order backward produces gradients; torch 2.13 does that only with find_unused_parameters and
   otherwise starts with one bucket of everything (`compute_bucket_size_limits` returns
   sys.maxsize when `not find_unused_parameters or static_graph`; older versions started with a
   first bucket of `dist._DEFAULT_FIRST_BUCKET_BYTES`). During the
   first iteration the Reducer records the order in which gradients really become ready, and
   before the second forward rebuilds the buckets in that order (`Reducer::rebuild_buckets`),
   so the first bucket is complete first. It never rebuilds with find_unused_parameters alone.
2. **gradient_as_bucket_view.** Each ``param.grad`` is a view into its bucket's flat buffer
   instead of a tensor of its own that is copied in and out: one copy of the gradients less.
3. **Unused parameters.** The Reducer waits for every parameter's gradient before a bucket is
   reduced. A parameter that gets none in a step leaves the reduction unfinished and the next
   forward raises; ``find_unused_parameters=True`` walks the autograd graph after each forward
   (`_post_forward` hands the outputs to `Reducer.prepare_for_backward`) to mark them ready;
   ``static_graph=True`` learns the set once in the first iteration.
4. **Communication hooks.** ``register_comm_hook`` replaces a bucket's all-reduce;
   ``bf16_compress_hook`` casts the bucket to bf16, divides by N, all-reduces and casts back.

    python -m labs.data_parallel.ddp_internals --world-size 2
"""
import statistics

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from labs.launcher import launch
from labs.measure import timing, wire

WIDTH = 256            # 256 x 256 fp32 = 256 KiB per layer:
CAP_MB = WIDTH * WIDTH * 4 / 2**20   # a bucket cap of one layer, so every layer fills a bucket of its own
FORWARD_ORDER = [2, 0, 3, 1]   # the order forward uses the layers; registration order is 0, 1, 2, 3
BF16_U = 2.0 ** -8     # bf16 unit roundoff: 8 significand bits, round to nearest
UNFINISHED = "Expected to have finished reduction in the prior iteration"


class Shuffled(torch.nn.Module):
    """Layers registered as l0..l3 but applied in ``order``: backward makes their gradients ready
    in the reverse of ``order``, not of registration. No biases: one parameter per layer, so the
    bucket order is the layer order. ``skip`` names a layer this forward leaves out (unused)."""

    def __init__(self, order=FORWARD_ORDER, width=WIDTH, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.order = list(order)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in self.order)
        for layer in self.layers:
            torch.nn.init.normal_(layer.weight, std=width ** -0.5)

    def forward(self, x, skip=None):
        for i in self.order:
            if i != skip:
                x = torch.tanh(self.layers[i](x))
        return (x ** 2).mean()


def predicted_ready_order(order):
    """Gradient-ready order from the model alone: backward meets the layers last-used first."""
    return list(reversed(order))


def _data(rank, step, width=WIDTH, batch=4):
    """Drawn on the CPU (the same numbers on any machine), then moved to this rank's device."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(batch, width, generator=g).to(launch.device())


def _net(**kwargs):
    return Shuffled(**kwargs).to(launch.device())


def _layer_of(net):
    ids = {id(layer.weight): i for i, layer in enumerate(net.layers)}
    return lambda params: [ids[id(p)] for p in params]


def bucket_order(rank, world_size, steps=3, find_unused=False):
    """Per step, the buckets in the order the comm hook saw them: (GradBucket.index(), layers).

    Layers, not parameters, because each layer has one. With ``find_unused=True`` the Reducer
    starts from reverse registration order and never rebuilds (it cannot trust one step's order).
    """
    net = _net()
    model = DDP(net, bucket_cap_mb=CAP_MB, find_unused_parameters=find_unused)
    layers, seen = _layer_of(net), []

    def hook(state, bucket):  # record, then reduce as DDP would (average)
        seen[-1].append((bucket.index(), layers(bucket.parameters())))
        return default_hooks.allreduce_hook(None, bucket)
    model.register_comm_hook(None, hook)
    for step in range(steps):
        seen.append([])
        model(_data(rank, step)).backward()
        net.zero_grad()
    return {"steps": seen, "registration": list(range(len(net.layers))),
            "predicted_ready": predicted_ready_order(net.order)}


def _storages(tensors):
    """Distinct storages among ``tensors``: {data_ptr: nbytes}."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def bucket_view(rank, world_size, as_view):
    """Distinct gradient storage bytes after one DDP step (the grads plus the bucket buffers the
    comm hook is handed), and whether every ``param.grad`` lives in a bucket buffer's storage."""
    net = _net()
    model = DDP(net, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=as_view)
    buffers = []

    def hook(state, bucket):
        buffers.append(bucket.buffer())
        return default_hooks.allreduce_hook(None, bucket)
    model.register_comm_hook(None, hook)
    for step in range(2):  # step 2 runs on the rebuilt buckets
        buffers.clear()
        model(_data(rank, step)).backward()
    grads = [p.grad for p in net.parameters()]
    grad_st, buf_st = _storages(grads), _storages(buffers)
    return {"grad_bytes": sum(g.numel() * g.element_size() for g in grads),
            "distinct_bytes": sum((grad_st | buf_st).values()),
            "grads_in_buckets": set(grad_st) <= set(buf_st)}


def single_process_grads(world_size, step, skip=None):
    """The reference: one process, every rank's batch, the mean loss over ranks (= DDP's average)."""
    net = _net()
    sum(net(_data(r, step), skip) for r in range(world_size)).div(world_size).backward()
    return [p.grad for p in net.parameters()]


def unused(rank, world_size, skip=3, steps=2):
    """A layer ``skip`` that no forward uses. Without a flag the second forward raises (its message
    is returned); find_unused_parameters=True and static_graph=True both train, and their
    averaged gradients are compared with one process in every step."""
    out = {}
    for name, kwargs in (("plain", {}), ("find_unused_parameters", {"find_unused_parameters": True}),
                         ("static_graph", {"static_graph": True})):
        net = _net()
        model, err = DDP(net, bucket_cap_mb=CAP_MB, **kwargs), 0.0
        try:
            for step in range(steps):
                model(_data(rank, step), skip).backward()
                ref = single_process_grads(world_size, step, skip)
                err = max([err] + [(p.grad - g).abs().max().item()
                                   for p, g in zip(net.parameters(), ref) if g is not None])
                net.zero_grad(set_to_none=False)
            out[name] = {"error": None, "max_grad_diff": err,
                         "unused_grad": None if net.layers[skip].weight.grad is None
                         else net.layers[skip].weight.grad.abs().max().item()}
        except RuntimeError as e:
            out[name] = {"error": str(e), "failed_at_step": step}
    return out


def walk_cost(rank, world_size, depth=48, width=16, steps=12):
    """Median forward+backward seconds with find_unused_parameters True and False, alternating
    steps, which flag goes first alternating pair by pair (so neither always runs first), on a
    deep narrow model (many graph nodes, little arithmetic: the walk shows); the ``..._all_s``
    lists keep every step in order, step i of each flag a pair."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth))).to(launch.device())
    models = {flag: DDP(build(), find_unused_parameters=flag) for flag in (True, False)}
    times = {True: [], False: []}
    for step in range(2 + 2 * steps):
        first = (step // 2) % 2 == 0
        flag = first if step % 2 == 0 else not first
        dist.barrier()
        start = timing.now()
        models[flag](_data(rank, step, width)).pow(2).mean().backward()
        if step >= 2:
            times[flag].append(timing.now() - start)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {"find_unused_s": on, "plain_s": off, "ratio": on / off, "depth": depth,
            "find_unused_all_s": times[True], "plain_all_s": times[False]}


def rounding_bound(local_grads, u):
    """Elementwise bound on |hook's average - exact average| for a reduction in precision ``u``.

    Each rank's gradient g_r is rounded once to the low precision and once when divided by N
    (exact for N a power of two), (1+u)^2; the ring then sums N such terms with N-1 roundings,
    at most gamma_{N-1} = (N-1)u / (1-(N-1)u) relative to the sum of magnitudes (Higham 2002,
    ch. 4). So |err| <= ((1+u)^2 (1+gamma_{N-1}) - 1) * sum_r |g_r| / N.
    """
    n = local_grads.shape[0]
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    return ((1 + u) ** 2 * (1 + gamma) - 1) * local_grads.abs().sum(0) / n


def compression(rank, world_size, hook=default_hooks.bf16_compress_hook, step_measured=1):
    """DDP without a hook (fp32 all-reduce) and with ``hook``, on the same data.

    Counted in the step ``step_measured`` (after the buckets are rebuilt): each bucket's fp32
    size as the hook receives it, and the library's wire bytes (gloo, `labs.measure.wire`) of this rank
    during backward, which then runs nothing but the buckets' all-reduces; the model of what
    gloo writes for those buckets in fp32 and in the hook's dtype. Errors of both averages
    against the exact average (float64, from every rank's local fp32 gradient), and the
    elementwise bound of `rounding_bound` with the low precision's unit roundoff.
    """
    dtype = torch.bfloat16 if hook is default_hooks.bf16_compress_hook else torch.float16
    nets = {"fp32": _net(), "hook": _net()}
    models = {k: DDP(net, bucket_cap_mb=CAP_MB) for k, net in nets.items()}
    sizes = {"fp32": [], "hook": []}

    def recording(kind, inner):
        def h(state, bucket):
            sizes[kind].append(bucket.buffer().numel())
            return inner(state, bucket)
        return h
    models["fp32"].register_comm_hook(None, recording("fp32", default_hooks.allreduce_hook))
    models["hook"].register_comm_hook(None, recording("hook", hook))
    wires = {}
    for step in range(step_measured + 1):
        for kind, model in models.items():
            sizes[kind].clear()
            loss = model(_data(rank, step))
            with wire.measure() as w:
                loss.backward()
            wires[kind] = w
            if step < step_measured:
                model.module.zero_grad()
    local = _net()
    local(_data(rank, step_measured)).backward()
    mine = torch.cat([p.grad.view(-1) for p in local.parameters()])
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    every = torch.stack(every).double()                       # (N, P): each rank's local gradient
    exact = every.mean(0)
    flat = {k: torch.cat([p.grad.view(-1) for p in net.parameters()]).double() for k, net in nets.items()}
    bound = rounding_bound(every, BF16_U if dtype == torch.bfloat16 else 2.0 ** -11)
    err = (flat["hook"] - exact).abs()
    return {"dtype": str(dtype), "bucket_numel": sizes["hook"],
            "wire_fp32": wires["fp32"].bytes, "wire_hook": wires["hook"].bytes,
            "wire_reason": wires["hook"].reason,
            "model_fp32_all_ranks": sum(wire.gloo_allreduce_all_ranks(4 * n, world_size, 4)
                                        for n in sizes["fp32"]),
            "model_hook_all_ranks": sum(wire.gloo_allreduce_all_ranks(2 * n, world_size, 2)
                                        for n in sizes["hook"]),
            "payload_fp32": sum(4 * n for n in sizes["fp32"]),
            "payload_hook": sum(2 * n for n in sizes["hook"]), "hook_err": err.max().item(),
            "fp32_err": (flat["fp32"] - exact).abs().max().item(),
            "hook_rel_err": (err.max() / exact.abs().max()).item(),
            "worst_err_over_bound": (err / bound.clamp_min(1e-300)).max().item(),
            "within_bound": bool((err <= bound).all()), "max_grad": exact.abs().max().item()}


def tour(rank, world_size):
    """Everything above in one spawn (the notebook's and the tests' single run)."""
    return {"order": bucket_order(rank, world_size),
            "order_find_unused": bucket_order(rank, world_size, find_unused=True),
            "view": bucket_view(rank, world_size, True), "copy": bucket_view(rank, world_size, False),
            "unused": unused(rank, world_size), "compression": compression(rank, world_size)}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("DDP internals: bucket rebuild, gradient_as_bucket_view, unused parameters, bf16 hook.")
    args = cli.parse(p, argv)
    results = launch.launch(tour, args.world_size, timeout=args.timeout)
    if results is None:
        return
    r = results[0]
    c = r["compression"]
    cli.report(r, args, f"buckets step 1: {r['order']['steps'][0]}, step 2: {r['order']['steps'][1]}; "
               f"grad storage bytes as view {r['view']['distinct_bytes']}, copied "
               f"{r['copy']['distinct_bytes']}; wire bytes fp32 {c['wire_fp32']}, {c['dtype']} hook "
               f"{c['wire_hook']}, hook error / bound <= {c['worst_err_over_bound']:.2f}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
