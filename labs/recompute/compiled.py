"""Chapter 9: recomputation chosen by the compiler, `torch.compile`'s activation memory budget, measured.

`torch.compile` traces forward and backward into one joint graph (AOTAutograd) and a partitioner
splits it into a forward graph, which returns what backward will need, and a backward graph. What
the split saves is decided in PyTorch's source, `torch/_functorch/partitioners.py` (torch 2.13):
- `min_cut_rematerialization_partition` reads the budget ``b`` from
  `torch._functorch.config.activation_memory_budget` (1.0 by default) and asks
  `choose_saved_values_set` for the saved set;
- at b = 1 that is `solve_min_cut`'s answer: a minimum cut of the joint graph weighted by tensor
  sizes, where only cheap operators may be recomputed (views, pointwise, some reductions; matrix
  products are banned from recomputation), so that runtime is not traded for memory;
- at b = 0 it is the graph's inputs alone (`node_info.inputs`: the weights and x here): everything
  else is recomputed in backward, the compiled region checkpointed whole;
- in between, a 0-1 knapsack (`config.activation_memory_budget_solver`, "dp" by default) picks
  which banned operators to allow to be recomputed: each costs its output's size, normalised
  between the b = 0 and b = 1 saved sizes, and is worth its runtime, estimated by counting its
  FLOPs with FlopCounterMode (`activation_memory_budget_runtime_estimator = "flops"`); the
  minimum cut is solved again with those operators allowed.
The config's comment defines the scale: 0.0 is the activation memory of checkpointing the whole
compiled region, 1.0 that of the default runtime-optimised strategy. The PyTorch blog post "Current
and New Activation Checkpointing Techniques in PyTorch" says the same (a budget of 0 "behaves like
plain-AC", 1 "like default torch.compile", in between a pareto-optimal selective policy) and that
the default min-cut partitioner recomputes mainly pointwise operators, since its goal is runtime.

The lab compiles L tiny GPT blocks and a loss whose gradient reads the output (sum of squares)
with an eager backend: AOTAutograd and the min-cut partitioner run as under Inductor, the
partitioned graphs run op by op, so no C++ compiler is needed. Per budget it measures:
- kept bytes: the storages of the tensors the compiled autograd node holds for backward
  (``loss.grad_fn.saved_tensors``, a `CompiledFunctionBackward`), less weights and buffers (x
  counts, as in `policies.measure`); checked against the partitioned backward graph's saved inputs.
  Not a live-storage dispatch mode, as the eager policies use: under an active TorchDispatchMode
  (`memory.PeakMemory`, FlopCounterMode) torch.compile runs the function eagerly instead, so it
  would measure eager autograd, not the compiled graph (the lab counts the compiled forward's runs);
- backward FLOPs, counted by FlopCounterMode around ``loss.backward()``;
- gradients against the uncompiled stack.
One process: what a rank saves for backward does not depend on the other ranks.

    python -m labs.recompute.compiled --budgets 1 0.5 0 --json
"""
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from labs.measure import flops, memory
from labs import model as tiny
from labs.recompute import policies

DTYPE = torch.bfloat16


def unavailable():
    """None where torch.compile can run here, else one sentence saying why it cannot."""
    import torch._dynamo
    if not torch._dynamo.is_dynamo_supported():
        return (f"torch.compile does not run on this platform (torch {torch.__version__}), "
                "so the compiler's recomputation is not measured here.")
    return None


def check_budgets(budgets):
    if not budgets or any(not 0.0 <= b <= 1.0 for b in budgets):
        raise ValueError(f"each activation memory budget must lie in [0, 1], got {list(budgets)}.")
    if list(budgets) != sorted(set(budgets), reverse=True):
        raise ValueError(f"give distinct budgets from highest to lowest, got {list(budgets)}.")


def _stack(cfg, batch, seed=0):
    """L blocks and an input, the same for every run with the same seed."""
    torch.manual_seed(seed)
    blocks = [tiny.Block(cfg).to(DTYPE) for _ in range(cfg.n_layer)]
    x = torch.randn(batch, cfg.seq_len, cfg.hidden, dtype=DTYPE, requires_grad=True)   # (B, T, H)
    return blocks, x


def loss_of(run):
    """The region's loss: its gradient reads the output, so backward needs every block's forward
    (a plain sum would not need the last matrix product's output, and nothing would recompute it)."""
    return lambda x: run(x).float().square().sum()


def _state_storages(blocks):
    seen = set()
    memory.storage_bytes([t for b in blocks for t in [*b.parameters(), *b.buffers()]], seen)
    return seen


def _by_op(mode):
    return {str(op).split(".")[-1]: n for op, n in mode.get_flop_counts().get("Global", {}).items()}


def _grads(blocks, x):
    return [x.grad] + [p.grad for b in blocks for p in b.parameters()]


def _backend(record):
    """An eager-executing torch.compile backend that still runs AOTAutograd and the min-cut
    partitioner (Inductor's default), recording the saved inputs of the backward graph and how
    often the compiled forward runs."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def partition(joint, inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        # the backward graph's inputs: what the forward saved ("primals_*" are the region's own
        # inputs, weights and x), then the output's gradients ("tangents_*")
        record["saved"] = [(n.name, n.meta["val"]) for n in bw.graph.nodes
                           if n.op == "placeholder" and not n.name.startswith("tangents")]
        return fw, bw

    def forward_compiler(gm, example_inputs):
        def run(args):
            record["forward_runs"] += 1
            return gm(*args)
        run._boxed_call = True
        return run

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm),
                        partition_fn=partition)


def measure_compiled(budget, cfg, batch):
    """One compiled forward and backward at activation memory budget ``budget``."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    blocks, x = _stack(cfg, batch)
    record = {"forward_runs": 0}
    torch._dynamo.reset()                     # a fresh compilation under this budget
    with functorch_config.patch(activation_memory_budget=budget):
        loss = torch.compile(loss_of(policies.apply_policy(blocks, "none")), backend=_backend(record))(x)
    node = loss.grad_fn
    if type(node).__name__ != "CompiledFunctionBackward" or record["forward_runs"] != 1:
        raise RuntimeError(f"the compiled graph did not run as one region ({type(node).__name__}, "
                           f"{record['forward_runs']} forward runs); nothing was measured.")
    saved = node.saved_tensors
    kept = memory.storage_bytes(list(saved), _state_storages(blocks))
    # the graph's view: saved inputs of the backward graph that are not the region's inputs
    graph_bytes = sum(v.numel() * v.element_size() for name, v in record["saved"]
                      if not name.startswith("primals"))
    with flops.counting() as bwd:
        loss.backward()
    return {"budget": budget, "kept_bytes": kept, "graph_saved_activation_bytes": graph_bytes,
            "saved_tensors": len(saved), "graph_saved_inputs": len(record["saved"]),
            "input_bytes": x.numel() * x.element_size(), "backward_flops": bwd.get_total_flops(),
            "backward_by_op": _by_op(bwd),
            "loss": loss.item(), "grads": _grads(blocks, x)}


def measure_eager(policy, cfg, batch):
    """The same stack and loss, uncompiled, under one of the chapter's hand policies: kept bytes
    as live storages after the forward (`memory.PeakMemory`), FLOPs counted (early stop off)."""
    blocks, x = _stack(cfg, batch)
    fn = loss_of(policies.apply_policy(blocks, policy))
    with set_checkpoint_early_stop(False), memory.PeakMemory(*blocks) as mem:
        loss = fn(x)
        kept = mem.end_bytes - mem.baseline_bytes - loss.untyped_storage().nbytes()
    blocks, x = _stack(cfg, batch)
    fn = loss_of(policies.apply_policy(blocks, policy))
    with set_checkpoint_early_stop(False):
        with flops.counting() as fwd:
            loss = fn(x)
        with flops.counting() as bwd:
            loss.backward()
    return {"policy": policy, "kept_bytes": kept, "forward_flops": fwd.get_total_flops(),
            "backward_flops": bwd.get_total_flops(), "backward_by_op": _by_op(bwd), "loss": loss.item(),
            "grads": _grads(blocks, x)}


def grad_bound(layers):
    """How far compiled gradients may be from the uncompiled ones under a backend whose kernels
    round differently, relative to each tensor's largest entry. Not this lab's backend: its
    partitioned graphs run the ATen operators that eager autograd runs (AOTAutograd traced them) and
    a recomputed operator reruns on the same inputs, so its gradients must equal eager's bit for bit
    (`compare`'s ``grads_equal_eager``). The bound is for Inductor's fused kernels:
    a bf16 result rounded the other way moves by up to 2^-8 of itself, and the gradient reaching a
    block's first weights passes about 4 such results per block (the two sublayers' LayerNorm and
    matrix product outputs), 4 L 2^-8 in all. A block recomputed from the wrong tensor exceeds it
    many times over (`wrong_input_grad_diff`)."""
    return 4 * layers * 2.0 ** -8


def wrong_input_grad_diff(cfg, batch):
    """A plausible partitioning bug, emulated eagerly: the last block's backward uses a wrong saved
    tensor of the right shape, the stack's input x instead of the block's input. The loss is the
    right one (the forward value is untouched), the gradients are not: their largest relative
    difference from the uncompiled stack's."""
    if cfg.n_layer < 2:
        raise ValueError("the wrong-input bug needs at least 2 layers: with 1, x is the last block's input.")
    blocks, x = _stack(cfg, batch)
    first, last = blocks[:-1], blocks[-1]

    def wrong(x):
        h = policies.apply_policy(first, "none")(x)
        stale = h + (x - h).detach()                     # the value of x, the gradient goes to h
        return last(stale) + (last(h) - last(stale)).detach()   # the value of last(h), its backward at x
    loss_of(wrong)(x).backward()
    ref_blocks, ref_x = _stack(cfg, batch)
    loss_of(policies.apply_policy(ref_blocks, "none"))(ref_x).backward()
    return max_relative_grad_diff(_grads(blocks, x), _grads(ref_blocks, ref_x))


def max_relative_grad_diff(grads, reference):
    """The largest |g - g_ref| over all gradients, each relative to its tensor's largest |g_ref|
    (a gradient that never arrived counts as zeros)."""
    return max(float(((r if g is None else g).float() * (g is not None) - r.float()).abs().max()
                     / r.float().abs().max()) for g, r in zip(grads, reference))


def compare(cfg=None, batch=2, budgets=(1.0, 0.5, 0.0), hand_policies=("none", "selective", "full")):
    """The compiled region at each budget beside the hand policies, all with the same loss."""
    check_budgets(budgets)
    cfg = cfg or policies.config(layers=2, seq=16)
    eager = {p: measure_eager(p, cfg, batch) for p in dict.fromkeys(("none", *hand_policies))}
    compiled = {b: measure_compiled(b, cfg, batch) for b in budgets}
    base = eager["none"]
    for r in [*eager.values(), *compiled.values()]:
        r["extra_backward_flops"] = r["backward_flops"] - base["backward_flops"]
        by_op, ref = r["backward_by_op"], base["backward_by_op"]
        r["recomputed_flops_by_op"] = {op: n - ref.get(op, 0) for op, n in by_op.items()
                                       if n != ref.get(op, 0)}
        r["max_rel_grad_diff_vs_eager"] = max_relative_grad_diff(r["grads"], base["grads"])
        r["grads_equal_eager"] = all(torch.equal(g, g0) for g, g0 in zip(r["grads"], base["grads"]))
        r["loss_diff_vs_eager"] = abs(r["loss"] - base["loss"])
    for r in [*eager.values(), *compiled.values()]:
        del r["grads"]
    return {"layers": cfg.n_layer, "hidden": cfg.hidden, "heads": cfg.n_head, "seq": cfg.seq_len,
            "batch": batch, "eager_forward_flops": base["forward_flops"], "eager": eager,
            "compiled": compiled}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("torch.compile's recomputation per activation memory budget: bytes kept for backward, "
                   "backward FLOPs and gradients, beside the hand policies.", world_size_default=1)
    p.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.0],
                   help="activation memory budgets, highest first (default 1 0.5 0)")
    p.add_argument("--layers", type=cli.at_most(8, "layers of the tiny stack"), default=2)
    p.add_argument("--seq", type=cli.at_most(64, "tokens per sequence"), default=16)
    p.add_argument("--batch", type=cli.at_most(16, "sequences per batch"), default=2)
    args = cli.parse(p, argv)
    if args.world_size != 1:
        raise ValueError(f"the compiler's recomputation is measured in one process; drop --world-size "
                         f"{args.world_size} or pass 1.")
    check_budgets(args.budgets)
    reason = unavailable()
    if reason:
        raise ValueError(reason)
    r = compare(policies.config(layers=args.layers, seq=args.seq), args.batch, tuple(args.budgets))
    lines = [f"budget {b:g}: {c['kept_bytes']} bytes kept, {c['backward_flops']} backward FLOPs"
             for b, c in r["compiled"].items()]
    cli.report(r, args, "\n".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
