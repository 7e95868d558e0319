"""Chapter 1, the memory budget: a calculator, and a lab that measures what it predicts.

Units: GB = 1e9 bytes, as the papers print them (ZeRO's Table 1, model states); GiB = 2**30 bytes,
what a GPU holds (an "80 GB" H100 has 80 GiB of HBM, 85.9e9 bytes). Sizes are reported in both
where it matters; the capacity a configuration must fit in is ``gpu_gib``.

Calculator (bytes per device):
- model state: a recipe's bytes per parameter (`labs.memory_budget.recipes`), sharded by ZeRO stage over dp
  (Rajbhandari et al. 2019, arXiv 1910.02054: stage 1 shards the optimizer state, stage 2 also the
  gradients, stage 3 also the weights) and split by tp and pp;
- activations of the Llama models: `labs.memory_budget.activations.llama_activation_terms` (derived op by op,
  measured on `labs.model.LlamaBlock`), with attention scores written out ("materialized") or
  through a fused kernel that keeps only its output and log-sum-exp ("flash": FlashAttention,
  Dao et al. 2022, arXiv 2205.14135; ``F.scaled_dot_product_attention``). The GPT-3 block of
  Korthikanti et al. 2022 (arXiv 2205.05198, Table 2), sbh(34 + 5as/h), is
  `activations.gpt3_activation_bytes_per_layer` (alias `activation_bytes_per_layer`) for GPT-3 shapes;
  `flash_at_scale` shows what a fused kernel removes at the real models' sizes.
The ZeRO paper's Table 1, entry by entry, and its communication volumes: `labs.memory_budget.zero_paper`.

Lab (`measure`): every rank builds the tiny model with a recipe, runs one data-parallel step and
counts its bytes by storage; and autograd's saved tensors of one block (GPT and Llama) are weighed
against the activation formulas.

    python -m labs.memory_budget.budget --model 70B --world-size 64 --tp 8 --zero-stage 1 --json
    python -m labs.memory_budget.budget --model 7B --zero-stage 1 --attention flash
    python -m labs.memory_budget.budget --measure --world-size 2 --json
"""
import math

import torch

from labs.measure import comm, exercises, memory, wire
from labs.launcher import launch
from labs import model as tiny
from labs.memory_budget import recipes as mixed_precision  # `recipes` names a parameter below
from labs.memory_budget.activations import (activation_bytes_per_layer, measure_activations, measure_llama)
from labs.formulas.memory import (  # the formulas' home is the torch-free core
    GB as GB, GIB as GIB, GPU_GIB as GPU_GIB, LINKS as LINKS, MODELS as MODELS, PEAK_FLOPS as PEAK_FLOPS,
    budget as budget, fewest_gpus as fewest_gpus, fit_grid as fit_grid, flash_at_scale as flash_at_scale,
    lowest_zero_stage as lowest_zero_stage, model_activations as model_activations, state_bytes_per_param
    as state_bytes_per_param)


# --- the lab -----------------------------------------------------------------------------------

def data_parallel_step(cfg, recipe, rank, batch_size):
    """One step of plain data parallelism with a recipe; returns the state this rank holds."""
    dev = launch.device()
    memory.reset_cuda_peak()  # on a GPU: this recipe's peak alone, not the process's so far
    net = tiny.build(cfg, seed=0, device=dev)  # same seed on every rank: replicas start equal
    opt = mixed_precision.prepare(net, recipe)
    x, y = tiny.synthetic_batch(cfg, batch_size, seed=rank, device=dev)  # each rank its own data
    net(x, y).backward()
    sizes = []  # (bytes, element size) of each all-reduce, for gloo's wire model
    with comm.counting(wire=True) as tally:  # wire: what gloo wrote to its sockets, per call
        for p in net.parameters():  # the gradient the optimizer will read
            g = p.main_grad if opt.recipe.grad_buffer else p.grad
            sizes.append((g.numel() * g.element_size(), g.element_size()))
            comm.all_reduce(g)
            g.div_(torch.distributed.get_world_size())
    opt.step()
    held = memory.state_bytes(net, opt)
    psi = tiny.num_params(net)
    checksum = sum(p.double().sum().item() for p in net.parameters())
    return {"numel": psi, "held": held, "bytes_per_param": held["total"] / psi,
            "formula": mixed_precision.recipe(recipe).bytes_per_param(),
            "allreduce_payload_bytes": tally.payload_bytes,
            "allreduce_formula_bytes": tally.formula_bytes_sent, "allreduce_calls": tally.calls("all_reduce"),
            "allreduce_wire_bytes": tally.wire_bytes_sent if not tally.wire_missing else None,
            "allreduce_sizes": sizes,
            "param_checksum": checksum, "cuda_peak_bytes": memory.cuda_peak_bytes()}


def measure(rank, world_size, recipes=tuple(mixed_precision.RECIPES), shapes=((1, 8), (2, 8), (2, 16)),
            batch_size=2):
    """The chapter-1 lab, on every rank: bytes per parameter by recipe, activations per block."""
    cfg = tiny.GPTConfig()
    result = {name: data_parallel_step(cfg, name, rank, batch_size) for name in recipes}
    act_cfg = tiny.GPTConfig(dropout=0.1)  # the GPT-3 formula assumes dropout everywhere
    return {"recipes": result, "activations": measure_activations(act_cfg, shapes, device=launch.device()),
            "llama_activations": measure_llama(shapes, device=launch.device())}


def gloo_wire_all_ranks(sizes, world_size):
    """Bytes all ranks together write for these all-reduces under gloo's ring, from gloo's source.

    ``sizes``: (bytes, element size) per call, as `data_parallel_step` records them. The model is
    `labs.measure.wire.gloo_allreduce_all_ranks`: the ring's 2(N-1)M and every message's preambles.
    """
    return sum(wire.gloo_allreduce_all_ranks(nbytes, world_size, es) for nbytes, es in sizes)


def state_gb(model, world_size, zero_stage, recipe="mixed"):
    """GB per device of parameters + gradients + optimizer state (no activations), pure data parallel."""
    return state_bytes_per_param(zero_stage, world_size, recipe)["total"] * MODELS[model].params() / GB


def nominal_params(model):
    """The parameter count a model's name suggests (70e9 for "70B"), not its real Psi."""
    return float(model.removesuffix("B")) * 1e9


def nominal_mistake(model):
    """The mistake of taking a model's name for its parameter count, in words."""
    return (f"the {nominal_params(model) / 1e9:g}e9 parameters of the model's name for its "
            f"{MODELS[model].params() / 1e9:.2f}e9 (chapter 1)")


def nominal(model, answer):
    """(the answer the nominal count gives, the mistake in words) for an ``answer()`` linear in Psi."""
    return lambda: answer() * nominal_params(model) / MODELS[model].params(), nominal_mistake(model)


# Chapter 1's exercises: the answers are computed here, so the book never types them.
EXERCISES = {
    "1": lambda: state_gb("13B", 8, zero_stage=2),
    "2": lambda: math.ceil(16 * MODELS["70B"].params() / (GPU_GIB * GIB)),  # 80 GiB GPUs
    "3": lambda: activation_bytes_per_layer(2048, 1, 12288, 96) / GB,
    "4": lambda: GPU_GIB * GIB / 16 / 1e9,  # billions of parameters in 80 GiB
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "1": [(lambda: state_gb("13B", 8, zero_stage=2, recipe="bf16_no_master"),
           "12 bytes per parameter: the fp32 master copy of the weights left out"),
          (lambda: 16 * MODELS["13B"].params() / GB,
           "ZeRO-2 forgotten: all 16 bytes per parameter on every GPU"),
          (lambda: (2 + 12 / 8) * MODELS["13B"].params() / GB,
           "the gradients left out: 2 + 12/N bytes per parameter"),
          (lambda: (2 + 16 / 8) * MODELS["13B"].params() / GB,
           "the bf16 weights counted twice: whole (2) and again in the sharded 16/N"),
          (lambda: state_gb("13B", 8, zero_stage=2) * GB / GIB,
           "GiB and GB mixed up: the answer given in GiB (2^30 bytes), the question asks for GB"),
          nominal("13B", lambda: state_gb("13B", 8, zero_stage=2))],
    "2": [(lambda: math.ceil(16 * MODELS["70B"].params() / (GPU_GIB * GB)), "80 GB taken for 80 GiB"),
          (lambda: math.ceil(16 * nominal_params("70B") / (GPU_GIB * GIB)), nominal_mistake("70B")),
          (lambda: math.ceil(12 * MODELS["70B"].params() / (GPU_GIB * GIB)),
           "12 bytes per parameter: the fp32 master copy of the weights left out")],
    "3": [(lambda: 34 * 2048 * 1 * 12288 / GB, "sbh(34 + 5as/h) without the attention scores' 5as/h"),
          (lambda: activation_bytes_per_layer(2048, 1, 12288, 96) / GB - 2048 * 12288 / GB,
           "one of the two sbh dropout masks left out: sbh(33 + 5as/h)"),
          (lambda: activation_bytes_per_layer(2048, 1, 12288, 96) / GB + 2048 * 12288 / GB,
           "one sbh dropout mask counted at 2 bytes, as a bf16 mask: sbh(35 + 5as/h)")],
    "4": [(lambda: GPU_GIB / 16, "80 GB taken for 80 GiB"),
          (lambda: GPU_GIB * GIB / 16 / 2**30, "a billion taken as 2^30: parameters counted in 2^30s"),
          (lambda: GPU_GIB * GIB / 12 / 1e9, "12 bytes per parameter instead of 16")],
}
check = exercises.checker(EXERCISES, MISTAKES)


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Memory budget per device (calculator: --world-size GPUs, default 8), or --measure "
                   "it on the tiny model (--world-size ranks, default 2).", world_size_default=None)
    p.add_argument("--measure", action="store_true", help="run the lab instead of the calculator")
    p.add_argument("--model", default="7B", choices=list(MODELS))
    p.add_argument("--tp", type=cli.positive_int, default=1)
    p.add_argument("--pp", type=cli.positive_int, default=1)
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0,
                   help="0 = plain data parallel, 1, 2 or 3")
    p.add_argument("--recipe", default="mixed", choices=list(mixed_precision.RECIPES))
    p.add_argument("--seq", type=cli.positive_int, default=4096)
    p.add_argument("--micro-batch", type=cli.positive_int, default=1)
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--attention", default="materialized", choices=["materialized", "flash"],
                   help="attention scores written out, or a fused kernel (FlashAttention, SDPA)")
    p.add_argument("--gpu-gib", type=cli.positive_float, default=GPU_GIB,
                   help="memory per GPU in GiB (default 80: an H100)")
    args = cli.parse(p, argv)
    if args.world_size is None:
        args.world_size = 2 if args.measure else 8
    if args.measure:
        results = launch.launch(measure, args.world_size, timeout=args.timeout)
        if results is None:
            return
        r0 = results[0]["recipes"]
        result = {"world_size": len(results),
                  "bytes_per_param": {k: v["bytes_per_param"] for k, v in r0.items()},
                  "formula": {k: v["formula"]["total"] for k, v in r0.items()},
                  "replicas_equal": all(r["recipes"] == results[0]["recipes"] for r in results),
                  "activations": results[0]["activations"],
                  "llama_activations_exact": {k: all(r["measured"] == r["formula"] for r in rows)
                                              for k, rows in results[0]["llama_activations"].items()}}
        lines = [f"{k:18s} measured {v:6.2f} B/param, formula {result['formula'][k]}" for k, v in
                 result["bytes_per_param"].items()]
        cli.report(result, args, "\n".join(lines))
        return
    r = budget(args.model, args.world_size, args.tp, args.pp, args.zero_stage, args.recipe, args.seq,
               args.micro_batch, args.recompute, args.sequence_parallel, args.attention, args.gpu_gib)
    g = r["gib_per_device"]
    summary = (f"{args.model} ({r['params'] / 1e9:.2f}B params) on {args.world_size} GPUs "
               f"(dp={r['dp']}, tp={args.tp}, pp={args.pp}, ZeRO-{args.zero_stage}, "
               f"{args.attention} attention, recompute {args.recompute}): "
               + ", ".join(f"{k} {v:.1f} GiB" for k, v in g.items())
               + f" -> {'fits' if r['fits'] else 'does not fit'} in {args.gpu_gib:g} GiB")
    cli.report(r, args, summary)


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
