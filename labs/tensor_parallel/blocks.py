"""Chapter 4: tensor parallelism proven: the Megatron-LM layers against the unsharded block.

Shoeybi et al. 2019 (arXiv 1909.08053); the layers, f and g and the column- and row-parallel
linears, are `labs.tensor_parallel.megatron`. Here each tensor-parallel MLP and attention block
runs beside the unsharded one (outputs, input gradient and every weight gradient, `check_block`),
every all-reduce's payload is read from the tensor f or g hands to the collective (one per block
in forward, one in backward, each of b*s*h elements: the b, s, h the lab set, so what the reading
shows is which tensor travels, the activation and not a weight), the tiny GPT trains under TP to
one process's losses and first gradients, every parameter's, replicated ones included (`train`; a
replicated gradient summed over the TP ranks is refused), PyTorch's DTensor plan gives the same
(`dtensor_mlp`), and `layer_costs` sets one layer's all-reduce time beside its compute time at scale.

    python -m labs.tensor_parallel.blocks --world-size 2 --block mlp --json
"""
import torch

from labs.measure import comm, exercises
from labs.launcher import launch, preflight
from labs import model as tiny
from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.tensor_parallel import megatron

def config(**overrides):
    """Heads and widths that tp = 1, 2, 3, 4 and 6 all divide (12 heads, h = 48, 4h = 192)."""
    return tiny.GPTConfig(**{"hidden": 48, "n_head": 12, **overrides})


def _full_block(kind, cfg):
    torch.manual_seed(0)
    return tiny.MLP(cfg) if kind == "mlp" else tiny.CausalSelfAttention(cfg)


def slice_of_full(name, full_grad, tp, rank, kind, cfg):
    """The part of the unsharded gradient that rank ``rank`` should hold for parameter ``name``."""
    hidden = cfg.hidden
    if kind == "mlp":
        rows = megatron.shard_rows(4 * hidden, tp, rank)
        pick = {"fc.weight": lambda g: g[rows], "fc.bias": lambda g: g[rows],
                "proj.weight": lambda g: g[:, rows]}
    else:
        rows = megatron.qkv_rows(hidden, cfg.n_head, tp, rank)
        pick = {"qkv.weight": lambda g: g[rows], "qkv.bias": lambda g: g[rows],
                "proj.weight": lambda g: g[:, rows[:hidden // tp]]}
    return pick.get(name, lambda g: g)(full_grad)  # replicated parameters: the whole gradient


def check_block(rank, world_size, kind="mlp", b=2, s=8, hidden=48):
    """A TP block beside the unsharded one: outputs, input gradient and every weight gradient.

    The all-reduces are read from the tensors f and g hand to the collective (`payloads`):
    allreduce_forward / allreduce_backward (calls), allreduce_payloads ({"forward": [bytes, ...],
    "backward": [...]}) and allreduce_bytes (the payload of the forward all-reduce). allreduce_bytes_sent
    is formula bytes: the ring's per-rank count for those measured payloads, 2(N-1)/N each (the
    library's wire bytes are `labs.measure.comm`'s business).
    """
    if kind not in ("mlp", "attention"):
        raise ValueError(f"block must be 'mlp' or 'attention', got {kind!r}.")
    cfg, dev = config(hidden=hidden), launch.device()
    full = _full_block(kind, cfg).to(dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, hidden, generator=g).to(dev)
    upstream = torch.randn(b, s, hidden, generator=g).to(dev)  # a fixed dL/dZ, the same on every rank
    x_ref = x.clone().requires_grad_()
    (full(x_ref) * upstream).sum().backward()
    ref_out = full(x_ref).detach()
    block = _full_block(kind, cfg).to(dev)
    (megatron.parallelize_mlp if kind == "mlp" else megatron.parallelize_attention)(block, None)
    x_tp = x.clone().requires_grad_()
    with megatron.payloads() as forward:
        out = block(x_tp)
    with megatron.payloads() as backward:
        (out * upstream).sum().backward()
    grads = {name: (p.grad - slice_of_full(name, dict(full.named_parameters())[name].grad, world_size, rank,
                                            kind, cfg)).abs().max().item()
             for name, p in block.named_parameters()}
    grads["input"] = (x_tp.grad - x_ref.grad).abs().max().item()
    calls = forward + backward
    return {"max_abs_error_output": (out - ref_out).abs().max().item(),
            "max_abs_error_grad": max(grads.values()), "grad_errors": grads,
            "allreduce_forward": len(forward), "allreduce_backward": len(backward),
            "allreduce_payloads": {"forward": [c["bytes"] for c in forward],
                                   "backward": [c["bytes"] for c in backward]},
            "allreduce_ops": [c["op"] for c in calls],
            "allreduce_bytes": forward[0]["bytes"] if forward else 0,  # g's tensor: this rank's partial sum
            "allreduce_bytes_sent": sum(_ring_bytes(c, world_size, rank) for c in calls),
            "local_params": sum(p.numel() for p in block.parameters()),
            "full_params": sum(p.numel() for p in full.parameters())}


def check_blocks(rank, world_size, kinds=("mlp", "attention"), b=2, s=8, hidden=48):
    """`check_block` for several kinds in one job (one process start instead of one per kind)."""
    return {kind: check_block(rank, world_size, kind, b, s, hidden) for kind in kinds}


def _ring_bytes(call, n, rank):
    """Formula bytes: what a ring all-reduce of this payload sends from ``rank`` (2(N-1)/N of it)."""
    return comm.ring_allreduce_elements(call["numel"], n, rank) * call["element_size"]


def message_bytes(rank, world_size, shapes):
    """The payload of the forward all-reduce in the TP MLP for each (b, s, h): the bytes of the tensor
    g handed to the collective, and its shape."""
    out = []
    for b, s, h in shapes:
        cfg = config(hidden=h, n_head=h // 4)
        block = megatron.parallelize_mlp(_full_block("mlp", cfg).to(launch.device()), None)
        with megatron.payloads() as log:
            block(torch.randn(b, s, h).to(launch.device()))
        out.append({"b": b, "s": s, "h": h, "calls": len(log), "message_bytes": log[0]["bytes"],
                    "shape": log[0]["shape"]})
    return out


def model_slice(name, full_grad, tp, rank, cfg):
    """`slice_of_full` for a parameter of the whole tiny GPT: a block's split weights by their
    block's rule; the embeddings, LayerNorms, head and row-parallel biases whole (replicated)."""
    parts = name.split(".")
    if parts[0] == "blocks" and parts[2] in ("attn", "mlp"):
        kind = "mlp" if parts[2] == "mlp" else "attention"
        return slice_of_full(".".join(parts[3:]), full_grad, tp, rank, kind, cfg)
    return full_grad


SUMMED_REPLICATED = "tp, replicated gradients summed over the TP ranks"


def train(rank, world_size, steps=3, batch_size=2, lr=1e-2):
    """The tiny GPT trained under tensor parallelism, and alone in one process: the same losses,
    and after the first backward every parameter's gradient equal to one process's (its slice).

    Adam's step hardly depends on the gradient's scale, so the losses alone cannot see a gradient
    off by a factor; the gradients are compared directly (`grad_errors`: the largest difference
    over the largest single-process entry, per parameter). A third run makes the named mistake,
    the replicated parameters' gradients all-reduced (SUM) over the TP ranks, tp times too large:
    its losses still agree, its gradients do not.
    """
    cfg, dev = config(), launch.device()
    losses, first_grads = {}, {}
    for mode in ("single", "tp", SUMMED_REPLICATED):
        net = tiny.build(cfg, seed=0, device=dev)
        if mode != "single":
            megatron.apply_tensor_parallel(net)
        opt = torch.optim.Adam(net.parameters(), lr=lr)
        losses[mode] = []
        for step in range(steps):
            x, y = tiny.synthetic_batch(cfg, batch_size, seed=step, device=dev)  # the same data on every rank
            loss = net(x, y)
            loss.backward()
            if mode == SUMMED_REPLICATED:  # the mistake: a replicated gradient is whole on every rank
                for name, p in net.named_parameters():
                    if p.shape == first_grads["single"][name].shape:
                        comm.all_reduce(p.grad)
            if step == 0:
                first_grads[mode] = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses[mode].append(loss.item())
    full = first_grads["single"]
    errors = {mode: {n: ((g - model_slice(n, full[n], world_size, rank, cfg)).abs().max()
                         / full[n].abs().max()).item() for n, g in first_grads[mode].items()}
              for mode in ("tp", SUMMED_REPLICATED)}
    held = sum(p.numel() for p in net.parameters())
    return {"losses_tp": losses["tp"], "losses_single": losses["single"],
            "losses_summed": losses[SUMMED_REPLICATED], "grad_errors": errors["tp"],
            "grad_errors_summed": errors[SUMMED_REPLICATED],
            "replicated": [n for n, g in first_grads["tp"].items() if g.shape == full[n].shape],
            "params_held": held, "params_full": tiny.num_params(tiny.build(cfg))}


def dtensor_mlp(rank, world_size, b=2, s=8):
    """PyTorch's DTensor tensor parallelism on the same MLP: same outputs and gradients as the hand one."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    cfg, dev = config(), launch.device()
    g = torch.Generator().manual_seed(1)
    x, upstream = (torch.randn(b, s, cfg.hidden, generator=g).to(dev),
                   torch.randn(b, s, cfg.hidden, generator=g).to(dev))
    hand = megatron.parallelize_mlp(_full_block("mlp", cfg).to(dev), None)
    lib = parallelize_module(_full_block("mlp", cfg).to(dev),
                             device_mesh(ParallelDims(tp=world_size), dev.type)["tp"],
                             {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    outs, grads = [], []
    for block in (hand, lib):
        xi = x.clone().requires_grad_()
        out = block(xi)
        (out * upstream).sum().backward()
        outs.append(out.detach())
        local = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                 for n, p in block.named_parameters()}
        grads.append(dict(local, input=xi.grad))
    placements = {n: str(p.placements) for n, p in lib.named_parameters()}
    return {"max_abs_error_output": (outs[0] - outs[1]).abs().max().item(),
            "max_abs_error_grad": max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]),
            "placements": placements}


def train_and_dtensor(rank, world_size):
    """`train` and `dtensor_mlp` in one job (one process start instead of two)."""
    return {"train": train(rank, world_size), "dtensor": dtensor_mlp(rank, world_size)}


def layer_costs(model="70B", tp=8, seq=4096, micro_batch=1, link="NVLink 4 (H100)",
                device="H100 SXM, bf16 dense", bytes_per_elem=2):
    """One layer's forward on one GPU at scale: the TP all-reduce time beside the compute time (formulas).

    Communication (Shoeybi et al. 2019, §3 and Fig. 4): two all-reduces per layer in forward (after
    attention, after the MLP), each of M = b*s*h*2 bytes of bf16 activations, each sending
    2(tp-1)/tp * M per GPU around a ring (Patarasuk & Yuan 2009).
    Compute, at the device's peak: the matmuls, 2 FLOPs per weight per token, 2 * (layer parameters
    / tp) * b * s (Kaplan et al. 2020, §2.1), plus the two s x s attention matmuls, q k^T and scores
    times v, 4 * b * s^2 * h / tp (Narayanan et al. 2021, arXiv 2104.04473, FLOPs appendix; a causal
    kernel can skip about half of them, not counted here).
    hh_weight_bytes: one h x h weight in bf16, h^2 * 2 bytes (128 MiB at h = 8192), a size the
    all-reduce is mistaken for (exercise 1); weights never travel in tensor parallelism.
    Link speeds are one direction and the peak is dense bf16, from the vendors' data sheets; a ring
    across nodes moves at the nodes' egress, `labs.formulas.links.ring_bandwidth`.
    """
    from labs.memory_budget import budget
    arch = budget.MODELS[model]
    message = micro_batch * seq * arch.hidden * bytes_per_elem
    sent = 2 * 2 * (tp - 1) / tp * message
    matmul_flops = 2 * arch.layer_params() / tp * micro_batch * seq
    attention_flops = 4 * micro_batch * seq ** 2 * arch.hidden / tp
    flops = matmul_flops + attention_flops
    return {"message_bytes": message, "sent_bytes": sent, "comm_s": sent / budget.LINKS[link],
            "matmul_flops": matmul_flops, "attention_flops": attention_flops, "flops": flops,
            "compute_s": flops / budget.PEAK_FLOPS[device],
            "hh_weight_bytes": arch.hidden ** 2 * bytes_per_elem}


# Chapter 4's exercises: the answers are computed here, so the book never types them.
TWO_NODES = "InfiniBand NDR, 8 NICs per node"     # tp = 16 on two 8-GPU nodes: links.ring_bandwidth
EXERCISES = {
    "1": lambda: layer_costs("70B", 8)["message_bytes"] / 2**20,
    "2": lambda: layer_costs("70B", 16, link=TWO_NODES)["comm_s"] * 1e3,
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "1": [(lambda: layer_costs("70B", 8)["hh_weight_bytes"] / 2**20,
           "sized by the h x h weight, not by b s h"),
          (lambda: layer_costs("70B", 8, bytes_per_elem=4)["message_bytes"] / 2**20,
           "the activation in fp32, 4 bytes per element (the lab's size); the question asks for bf16, 2"),
          (lambda: layer_costs("70B", 8)["message_bytes"] / 2**20 / 8,
           "divided by tp: each rank's all-reduce carries the whole b s h activation")],
    "2": [(lambda: layer_costs("70B", 16, link=TWO_NODES)["comm_s"] * 1e3 * 16 / 15,
           "the ring factor 2(tp-1)/tp read as 2: at tp = 16 it is 2 x 15/16"),
          # 16/15 = 1.067 lies within 1 % of 2^30/10^9 = 1.074: such an answer is told both
          (lambda: EXERCISES["2"]() * exercises.GB_PER_GIB, exercises.SLIPS[2][1]),
          (lambda: layer_costs("70B", 16, link="InfiniBand NDR (400 Gb/s)")["comm_s"] * 1e3,
           "one NIC's 50 GB/s for the whole ring: the node has 8 NICs and the ring uses them all"),
          (lambda: layer_costs("70B", 16, link=TWO_NODES)["comm_s"] * 1e3 / 8,
           "400 Gb/s per NIC read as 400 GB/s"),
          (lambda: layer_costs("70B", 8, link=TWO_NODES)["comm_s"] * 1e3,
           "tp = 8's ring factor 2 x 7/8; at tp = 16 it is 2 x 15/16")],
}


def check(question, answer, rel=0.01):
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES)


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Megatron tensor parallelism: a TP block against the unsharded one, all-reduces counted.")
    p.add_argument("--block", choices=("mlp", "attention"), default="mlp")
    p.add_argument("--batch", type=cli.positive_int, default=2)
    p.add_argument("--seq", type=cli.positive_int, default=8)
    p.add_argument("--hidden", type=cli.positive_int, default=48, help="hidden size h (12 heads of h/12)")
    args = cli.parse(p, argv)
    if args.hidden % 12:
        raise ValueError(f"--hidden {args.hidden} is not a multiple of the 12 heads; use e.g. 48.")
    megatron.check_degree(config(hidden=args.hidden), args.world_size)
    # fp32: the block's 12 h^2 weights and b*s*h activations, for the reference, the shard and their
    # gradients (a generous x8), so an impossible size is refused before any rank starts
    h, bsh = args.hidden, args.batch * args.seq * args.hidden
    preflight.check_fits(args.world_size, 8 * 4 * (12 * h * h + 16 * bsh), "--hidden, --batch or --seq")
    results = launch.launch(check_block, args.world_size, args.block, args.batch, args.seq, args.hidden,
                            timeout=args.timeout)
    if results is None:
        return
    keys = ("max_abs_error_output", "max_abs_error_grad")
    result = {k: max(r[k] for r in results) for k in keys}
    result.update({k: results[0][k] for k in ("allreduce_forward", "allreduce_backward", "allreduce_bytes")},
                  world_size=len(results), block=args.block)
    cli.report(result, args, f"TP {args.block} on {len(results)} ranks: max error output "
               f"{result['max_abs_error_output']:.1e}, grads {result['max_abs_error_grad']:.1e}; all-reduces "
               f"{result['allreduce_forward']} forward + {result['allreduce_backward']} backward of "
               f"{result['allreduce_bytes']} bytes each (b*s*h*4)")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
