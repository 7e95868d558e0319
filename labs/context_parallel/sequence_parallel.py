"""Chapter 6: Megatron sequence parallelism on chapter 4's tensor-parallel block, proven.

Korthikanti et al. 2022 (arXiv 2205.05198, §4.2.2). Tensor parallelism (`labs.tensor_parallel.blocks`)
leaves the LayerNorms, the dropouts and the residual adds replicated: every one of the t ranks
keeps their b*s*h activations in full. Sequence parallelism splits those regions along the
sequence, each rank holding s/t tokens, and gives chapter 4's f and g new collectives (the book's
f_sp and g_sp, the paper's g and g-bar): f_sp is an all-gather along the sequence in forward and a
reduce-scatter in backward (before the column-parallel layer), g_sp a reduce-scatter in forward and
an all-gather in backward (after the row-parallel layer). An all-reduce is a reduce-scatter followed
by an all-gather, so the bytes on a ring are those of TP; the activations in the sequence-split
regions shrink t-fold.

The column-parallel layer keeps only its s/t-token input shard for backward and gathers it again
there for the weight gradient, as Megatron-LM does (megatron/core/tensor_parallel/layers.py,
LinearWithGradAccumulationAndAsyncCommunication, which overlaps that gather with the input-gradient
matmul; the lab runs it synchronously). That is what makes the per-rank activations
sbh(34/t + 5as/(ht)) rather than sbh(4 + 30/t + 5as/(ht)) (`regather=False` keeps the gathered
input instead, to show the difference). LayerNorm weights and the row-parallel biases
see only their rank's tokens, so their gradients are partial: `sync_grads` all-reduces them.
The layers are `labs.context_parallel.sp_layers`; this file is the lab that proves them against
chapter 4's block and one process, and PyTorch's own ``SequenceParallel`` beside them.

    python -m labs.context_parallel.sequence_parallel --world-size 2 --json
"""
import contextlib
import torch

from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.memory_budget import activations
from labs.measure import comm
from labs.data_parallel import hand_ring
from labs.launcher import launch, preflight
from labs.context_parallel import sequence_parallel_activations as spa, sp_layers
from labs.tensor_parallel import blocks as tp, megatron


# --- the lab: the same numbers as TP and one process, the same bytes as TP's all-reduces ----------

def _run(block, x, upstream, group=None, sync=False):
    """Forward and backward, each under a payload log and a `comm` tally (counted messages inside
    `hand_ring.hand_collectives()`); then, if ``sync``, the parameter-gradient all-reduce, logged apart."""
    x = x.clone().requires_grad_()
    with megatron.payloads() as fwd, comm.counting() as fwd_tally:
        out = block(x)
    with megatron.payloads() as bwd, comm.counting() as bwd_tally:
        (out * upstream).sum().backward()
    with megatron.payloads() as params:
        if sync:
            sp_layers.sync_grads(block, group)
    return {"out": out.detach(), "input_grad": x.grad,
            "grads": {n: p.grad for n, p in block.named_parameters()}, "forward": fwd, "backward": bwd,
            "params": params, "tallies": (fwd_tally, bwd_tally)}


def _slice_of_full(name, grad, t, rank, cfg):
    """The part of the one-process gradient that this rank's parameter ``name`` should hold."""
    part, _, rest = name.partition(".")
    kind = {"attn": "attention", "mlp": "mlp"}.get(part)
    return tp.slice_of_full(rest, grad, t, rank, kind, cfg) if kind else grad


def _max_err(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _ops(log):
    return [c["op"] for c in log]


def check_block(rank, world_size, b=2, s=12, hidden=48, regather=True, hand=True):
    """One TP+SP block beside the TP block (chapter 4) and the one-process block, fp32, dropout off.

    Errors: output and gradients against one process (max_abs_error, max_abs_error_grad) and against
    TP alone (*_vs_tp). Collectives, read from the tensors handed to them: *_ops (names in order),
    *_payloads (bytes). counted_bytes_sent: the bytes this rank's messages carried (hand rings of
    `hand_ring.hand_collectives()`, counted message by message) for SP and for TP, forward and backward.
    """
    cfg, dev, t = tp.config(hidden=hidden), launch.device(), world_size
    megatron.check_degree(cfg, t)
    if s % t:
        raise ValueError(f"sequence length s = {s} is not divisible by tp = {t}; choose s divisible by tp.")
    g = torch.Generator().manual_seed(1)
    x, upstream = (torch.randn(b, s, hidden, generator=g).to(dev) for _ in range(2))   # (B, s, H) each
    mine = sp_layers._tokens(s, t, rank)
    full = _run(sp_layers._block(cfg, dev), x, upstream)
    tp_block = sp_layers._block(cfg, dev)
    megatron.parallelize_attention(tp_block.attn, None), megatron.parallelize_mlp(tp_block.mlp, None)
    sp_block = sp_layers.parallelize_block(sp_layers._block(cfg, dev), None, regather)
    with hand_ring.hand_collectives() if hand else contextlib.nullcontext():
        tpr = _run(tp_block, x, upstream)
        spr = _run(sp_block, x[:, mine], upstream[:, mine], sync=True)   # this rank's s/t tokens
    want = {n: _slice_of_full(n, full["grads"][n], t, rank, cfg) for n in spr["grads"]}
    grads_tp = {n: v[:, mine] if n == "input" else v
                for n, v in dict(tpr["grads"], input=tpr["input_grad"]).items()}
    bytes_of = {k: [tally.bytes_sent for tally in r["tallies"]] for k, r in (("sp", spr), ("tp", tpr))}
    return {"max_abs_error": (spr["out"] - full["out"][:, mine]).abs().max().item(),
            "max_abs_error_vs_tp": (spr["out"] - tpr["out"][:, mine]).abs().max().item(),
            "max_abs_error_grad": _max_err(dict(spr["grads"], input=spr["input_grad"]),
                                           dict(want, input=full["input_grad"][:, mine])),
            "max_abs_error_grad_vs_tp": _max_err(dict(spr["grads"], input=spr["input_grad"]), grads_tp),
            "forward_ops": _ops(spr["forward"]), "backward_ops": _ops(spr["backward"]),
            "param_ops": _ops(spr["params"]), "tp_ops": _ops(tpr["forward"] + tpr["backward"]),
            "forward_payloads": [c["bytes"] for c in spr["forward"]],
            "backward_payloads": [c["bytes"] for c in spr["backward"]],
            "param_payloads": [c["bytes"] for c in spr["params"]],
            "tp_payloads": [c["bytes"] for c in tpr["forward"] + tpr["backward"]],
            "counted_bytes_sent": {"sp_forward": bytes_of["sp"][0], "sp_backward": bytes_of["sp"][1],
                                   "tp_forward": bytes_of["tp"][0], "tp_backward": bytes_of["tp"][1]}
            if hand else None, "regather": regather}


# --- PyTorch's own: SequenceParallel beside ColwiseParallel / RowwiseParallel ---------------------

def dtensor_plan():
    """`parallelize_module`'s plan for the same split: LayerNorms on Shard(1) (the sequence),
    the column-parallel inputs all-gathered from Shard(1), the row-parallel outputs reduce-scattered
    to Shard(1); local tensors between the modules, so the residual adds stay plain."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    def col():
        return ColwiseParallel(input_layouts=Shard(1))

    def row():
        return RowwiseParallel(output_layouts=Shard(1))

    return {"ln1": SequenceParallel(use_local_output=True), "attn.qkv": col(), "attn.proj": row(),
            "ln2": SequenceParallel(use_local_output=True), "mlp.fc": col(), "mlp.proj": row()}


def dtensor_block(rank, world_size, b=2, s=12, hidden=48):
    """The hand TP+SP block beside `parallelize_module` with `dtensor_plan`, fp32: outputs and every
    gradient (DTensor gradients as this rank's local shard). ColwiseParallel shards the fused qkv
    weight in contiguous rows, so its rows are first reordered to put rank i's q, k and v heads in
    block i (`megatron.qkv_rows`)."""
    from torch.distributed.tensor.parallel import parallelize_module
    cfg, dev, t = tp.config(hidden=hidden), launch.device(), world_size
    g = torch.Generator().manual_seed(1)
    x, upstream = (torch.randn(b, s, hidden, generator=g).to(dev)[:, sp_layers._tokens(s, t, rank)]
                   for _ in range(2))
    hand = sp_layers.parallelize_block(sp_layers._block(cfg, dev), None)
    lib = sp_layers._block(cfg, dev)
    order = torch.cat([megatron.qkv_rows(hidden, cfg.n_head, t, r) for r in range(t)])
    with torch.no_grad():
        lib.attn.qkv.weight.copy_(lib.attn.qkv.weight[order])
        lib.attn.qkv.bias.copy_(lib.attn.qkv.bias[order])
    lib.attn.n_head //= t
    lib = parallelize_module(lib, device_mesh(ParallelDims(tp=t), dev.type)["tp"], dtensor_plan())
    runs = [_run(hand, x, upstream, sync=True), _run(lib, x, upstream)]
    # DTensor leaves the LayerNorm gradients Partial(sum): each rank holds its tokens' share, the sum
    # happens when something asks for the full value (full_tensor: an all-reduce, as `sync_grads`)
    partial = sorted(n for n, p in lib.named_parameters() if any(q.is_partial() for q in p.grad.placements))
    local = [{n: (v.full_tensor() if n in partial else v.to_local()) if hasattr(v, "to_local") else v
              for n, v in dict(r["grads"], input=r["input_grad"]).items()} for r in runs]
    return {"max_abs_error": (runs[0]["out"] - runs[1]["out"]).abs().max().item(),
            "max_abs_error_grad": _max_err(local[0], local[1]),
            "grad_errors": {n: (local[0][n] - local[1][n]).abs().max().item() for n in local[0]},
            "partial_grads": partial,
            "placements": {n: str(p.placements) for n, p in lib.named_parameters()}}


def lab(rank, world_size, b=2, s=12, hidden=48, dtensor=False, keep_gathered=False):
    """`check_block` (counted messages) and `sequence_parallel_activations.activation_table` in one job;
    `dtensor_block` too when ``dtensor``, and `check_block` keeping the gathered input when
    ``keep_gathered`` (starting ranks costs more than these small runs)."""
    out = {"check": check_block(rank, world_size, b, s, hidden),
           "table": spa.activation_table(rank, world_size, b, s, hidden)}
    if dtensor:
        out["dtensor"] = dtensor_block(rank, world_size, b, s, hidden)
    if keep_gathered:
        out["keep_gathered"] = check_block(rank, world_size, b, s, hidden, regather=False)
    return out


def forward_bytes_per_layer(b, s, h, t, bytes_per_elem=2):
    """Formula bytes one rank sends in one layer's forward on a ring (Patarasuk & Yuan 2009): TP's
    two all-reduces of M = b*s*h*bytes, 2(t-1)/t * M each, against SP's two all-gathers and two
    reduce-scatters, (t-1)/t * M each. Equal by algebra (an all-reduce is a reduce-scatter and an
    all-gather): a derivation, not a finding. What is measured is `check_block`'s counted bytes on
    the tiny block, TP's and SP's each from its own messages, which the tests compare with this."""
    m = b * s * h * bytes_per_elem
    return {"message_bytes": m, "tp": 2 * 2 * (t - 1) / t * m, "sp": 2 * ((t - 1) / t * m + (t - 1) / t * m)}


# Chapter 6's exercises: GPT-3 175B shapes (Brown et al. 2020, Table 2.1: h = 12288, 96 heads,
# s = 2048) at t = 4, b = 1 (the page works t = 8): computed here, so the book never types them.
EXERCISES = {
    "1": lambda: activations.gpt3_activation_bytes_per_layer(2048, 1, 12288, 96, tp=4, sp=True) / 2**20,
    "2": lambda: forward_bytes_per_layer(1, 2048, 12288, 4)["sp"] / 2**20,
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "1": [(lambda: activations.gpt3_activation_bytes_per_layer(2048, 1, 12288, 96, tp=4) / 2**20,
           "the TP-only row sbh(10 + 24/t + 5as/(ht)): the 10sbh left whole"),
          (lambda: 2048 * 12288 * (34 / 4 + 5 * 96 * 2048 / 12288) / 2**20,
           "the scores' 5as/h not divided by t"),
          (lambda: activations.gpt3_activation_bytes_per_layer(2048, 1, 12288, 96) / 2**20,
           "the unsplit layer's, not one rank's"),
          (lambda: activations.gpt3_activation_bytes_per_layer(2048, 1, 12288, 96, tp=8, sp=True) / 2**20,
           "the page's t = 8 used: the exercise asks for t = 4")],
    "2": [(lambda: forward_bytes_per_layer(1, 2048, 12288, 4)["sp"] / 2 / 2**20,
           "the all-gathers only: the reduce-scatters left out"),
          (lambda: 4 * forward_bytes_per_layer(1, 2048, 12288, 4)["message_bytes"] / 2**20,
           "all of M per collective: the ring's (t-1)/t left out"),
          (lambda: 2 * forward_bytes_per_layer(1, 2048, 12288, 4)["sp"] / 2**20,
           "each of SP's four collectives priced as an all-reduce")],
}


def check(question, answer, rel=0.01):
    from labs.measure import exercises
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES)


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Megatron sequence parallelism: a TP+SP block against TP and one process, collectives "
                   "counted, activations measured against Korthikanti et al. 2022, Table 2.")
    p.add_argument("--batch", type=cli.positive_int, default=2)
    p.add_argument("--seq", type=cli.positive_int, default=12,
                   help="sequence length s (divisible by the world size)")
    p.add_argument("--hidden", type=cli.positive_int, default=48, help="hidden size h (12 heads of h/12)")
    args = cli.parse(p, argv)
    if args.hidden % 12:
        raise ValueError(f"--hidden {args.hidden} is not a multiple of the 12 heads; use e.g. 48.")
    megatron.check_degree(tp.config(hidden=args.hidden), args.world_size)
    if args.seq % args.world_size or args.seq > tp.config().seq_len:
        raise ValueError(f"--seq {args.seq} must be divisible by the world size {args.world_size} "
                         f"and at most {tp.config().seq_len}; use e.g. 12.")
    h, bsh = args.hidden, args.batch * args.seq * args.hidden   # fp32 weights and activations, generously
    preflight.check_fits(args.world_size, 8 * 4 * (12 * h * h + 40 * bsh), "--hidden, --batch or --seq")
    results = launch.launch(lab, args.world_size, args.batch, args.seq, args.hidden, timeout=args.timeout)
    if results is None:
        return
    c = results[0]["check"]
    result = {k: max(r["check"][k] for r in results) for k in ("max_abs_error", "max_abs_error_grad",
                                                                  "max_abs_error_vs_tp",
                                                               "max_abs_error_grad_vs_tp")}
    result.update({k: c[k] for k in ("forward_ops", "backward_ops", "forward_payloads", "backward_payloads",
                                     "tp_payloads", "counted_bytes_sent")}, world_size=len(results),
                  activation_bytes={row: {k: v[k] for k in ("measured", "formula", "layernorm_stats")}
                                    for row, v in results[0]["table"].items()})
    cli.report(result, args, f"TP+SP block on {len(results)} ranks: max error {result['max_abs_error']:.1e}, "
               f"grads {result['max_abs_error_grad']:.1e}; counted bytes sent per rank "
               f"{c['counted_bytes_sent']}; activation bytes per rank (measured): "
               + ", ".join(f"{k} {v['measured']}" for k, v in result["activation_bytes"].items()))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
