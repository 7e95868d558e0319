"""Chapter 1, the memory budget: a calculator, and a lab that measures what it predicts.

Calculator (bytes per device, GB = 1e9 bytes as in the papers):
- model state: a recipe's bytes per parameter (`labs.precision`), sharded by ZeRO stage over dp
  (Rajbhandari et al. 2019, arXiv 1910.02054: stage 1 shards the optimizer state, stage 2 also the
  gradients, stage 3 also the weights) and split by tp and pp;
- activations: Korthikanti et al. 2022 (arXiv 2205.05198, Table 2), per layer
  s*b*h*(34 + 5*a*s/h) bytes with no parallelism and no recomputation.

Lab (`measure`): every rank builds the tiny model with a recipe, runs one data-parallel step and
counts its bytes by storage; and autograd's saved tensors of one block are weighed against the
activation formula.

    python -m labs.budget --model 70B --world-size 64 --tp 8 --zero-stage 1 --json
    python -m labs.budget --measure --world-size 2 --json
"""
import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

import torch

from labs import comm, exercises, launch, memory, model as tiny, precision

GB = 1e9


@dataclass(frozen=True)
class Arch:
    """Published shapes (Touvron et al. 2023 for Llama 2; Llama 3 Herd paper, 2024, for 405B)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def layer_params(self):
        return (self.params() - 2 * self.vocab * self.hidden - self.hidden) // self.layers

    def params(self):
        """Llama block: q, o (h x h); k, v (h x kv*d); SwiGLU (3 matrices h x ffn); 2 RMSNorms."""
        kv = self.kv_heads * (self.hidden // self.heads)
        per_layer = 2 * self.hidden ** 2 + 2 * self.hidden * kv + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden  # + embed, head, final norm


MODELS = {
    "7B": Arch(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    "13B": Arch(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000),
    "70B": Arch(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000),
    "405B": Arch(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256),
}


def state_bytes_per_param(zero_stage=0, dp=1, recipe="mixed"):
    """Per-rank bytes per parameter of the model state under ZeRO over ``dp`` ranks."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0 (plain data parallel), 1, 2 or 3, got {zero_stage!r}.")
    b = precision.recipe(recipe).bytes_per_param()
    out = {"parameters": b["parameters"] / (dp if zero_stage >= 3 else 1),
           "gradients": b["gradients"] / (dp if zero_stage >= 2 else 1),
           "optimizer_state": b["optimizer_state"] / (dp if zero_stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(s, b, h, a, tp=1, sp=False, recompute="none", dropout=True):
    """Korthikanti et al. 2022, Table 2: 16-bit activations and 1-byte dropout masks.

    With dropout off (as Llama trains) the three masks go (2sbh + a*s*s*b) and the attention
    dropout output no longer differs from the softmax output (2*a*s*s*b): 32 + 2as/h.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}.")
    if recompute == "full":
        return 2 * s * b * h  # only each layer's input is kept
    linear, scores = (34, 5) if dropout else (32, 2)
    replicated = 0 if sp else 10 if dropout else 8  # LayerNorm inputs, dropout masks, QKV/FC inputs
    per_token = replicated + (linear - replicated) / tp
    attention = 0 if recompute == "selective" else scores * a * s / (h * tp)
    return s * b * h * (per_token + attention)


def budget(model="7B", world_size=8, tp=1, pp=1, zero_stage=0, recipe="mixed", seq=4096,
           micro_batch=1, recompute="none", sp=False, gpu_gb=80.0):
    """Bytes per device for one configuration, and whether it fits in ``gpu_gb``."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}.")
    if world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not divisible by tp*pp = {tp * pp}; "
                         f"choose tp and pp whose product divides {world_size}.")
    arch, dp = MODELS[model], world_size // (tp * pp)
    if arch.layers % pp or arch.heads % tp:
        raise ValueError(f"{model} has {arch.layers} layers and {arch.heads} heads: pp must divide "
                         f"the layers and tp the heads (got pp={pp}, tp={tp}).")
    psi = arch.params()
    per_param = state_bytes_per_param(zero_stage, dp, recipe)
    state = {k: v * psi / (tp * pp) for k, v in per_param.items() if k != "total"}
    # 1F1B: the first stage holds pp micro-batches of its L/pp layers, i.e. L layers' worth.
    acts = arch.layers * activation_bytes_per_layer(seq, micro_batch, arch.hidden, arch.heads, tp, sp, recompute)
    dev = dict(state, activations=acts)
    dev["total"] = sum(dev.values())
    return {"model": model, "params": psi, "world_size": world_size, "dp": dp, "tp": tp, "pp": pp,
            "zero_stage": zero_stage, "recipe": recipe, "seq": seq, "micro_batch": micro_batch,
            "recompute": recompute, "sequence_parallel": sp, "gpu_gb": gpu_gb,
            "gb_per_device": {k: v / GB for k, v in dev.items()}, "fits": dev["total"] <= gpu_gb * GB}


def zero_comm_bytes(stage, psi, n, bytes_per_elem=2):
    """Bytes each rank sends per step (ring model): (N-1)/N x {2, 2, 2, 3} x Psi x bytes."""
    return (3 if stage == 3 else 2) * (n - 1) / n * psi * bytes_per_elem


def zeropp_cross_node_bytes(psi):
    """ZeRO-3 vs ZeRO++ (Wang et al. 2023, arXiv 2306.10209) bytes across nodes per parameter pass,
    large N: all-gather weights (bf16 -> int8, qwZ), backward all-gather kept inside the node (hpZ:
    0 across), reduce-scatter gradients (bf16 -> int4, qgZ)."""
    return {"zero3": 2 * psi + 2 * psi + 2 * psi, "zeropp": 1 * psi + 0 + 0.5 * psi}


# Link speeds, one direction, from the vendors' specifications (bytes per second).
LINKS = {"PCIe 4.0 x16": 32e9, "PCIe 5.0 x16": 64e9, "NVMe drive (PCIe 4.0 x4)": 7e9,  # NVMe: a fast drive's read rate
         "NVLink 4 (H100)": 450e9, "InfiniBand NDR (400 Gb/s)": 50e9}
PEAK_FLOPS = {"H100 SXM, bf16 dense": 989e12}


def offload_seconds(psi, link):
    """ZeRO-Offload's traffic per step: bf16 gradients to the CPU, bf16 weights back (2 + 2 bytes)."""
    return 2 * psi / LINKS[link]  # both directions at once: 2 bytes each way per parameter


# ZeRO paper, Table 1: per-device GB for a 7.5B model with K=12, by DP degree (the published values).
ZERO_PAPER_PSI = 7.5e9
ZERO_PAPER_TABLE1 = {
    "dp": [1, 4, 16, 64, 256, 1024],
    0: [120, 120, 120, 120, 120, 120],
    1: [120, 52.5, 35.6, 31.4, 30.4, 30.1],
    2: [120, 41.3, 21.6, 16.6, 15.4, 15.1],
    3: [120, 30, 7.5, 1.88, 0.47, 0.12],
}


def zero_table1():
    """Table 1 recomputed from `state_bytes_per_param`: {stage: [GB per device for each dp]}."""
    return {stage: [state_bytes_per_param(stage, dp)["total"] * ZERO_PAPER_PSI / GB
                    for dp in ZERO_PAPER_TABLE1["dp"]] for stage in (0, 1, 2, 3)}


def matches_paper(computed, published):
    """Equal at the precision the paper prints each value, rounding half up as it does (41.25 -> 41.3)."""
    def printed(c, p):
        return Decimal(repr(c)).quantize(Decimal(str(p)), rounding=ROUND_HALF_UP) == Decimal(str(p))
    return all(printed(c, p) for c, p in zip(computed, published))


# --- the lab -----------------------------------------------------------------------------------

def layernorm_stat_bytes(h=8, dtype=torch.bfloat16, device="cpu"):
    """Bytes per token LayerNorm keeps beside its input (mean and 1/std), measured on ``device``:
    2 x 2 in bf16 on a CPU; a GPU kernel may keep them in fp32."""
    ln = torch.nn.LayerNorm(h).to(device=device, dtype=dtype)
    x = torch.randn(1, 1, h, dtype=dtype, device=device, requires_grad=True)
    with memory.saved_for_backward(ln) as saved:
        ln(x)
    return saved.bytes - h * x.element_size()


def measure_activations(cfg, shapes, dtype=torch.bfloat16, device="cpu"):
    """Saved-for-backward bytes of one block at each (b, s), beside the formula."""
    rows = []
    stat_bytes = layernorm_stat_bytes(cfg.hidden, dtype, device)
    for b, s in shapes:
        block = tiny.Block(cfg).to(device=device, dtype=dtype).train()
        x = torch.randn(b, s, cfg.hidden, dtype=dtype, device=device, requires_grad=True)
        with memory.saved_for_backward(block) as saved:
            block(x)
        formula = activation_bytes_per_layer(s, b, cfg.hidden, cfg.n_head, dropout=cfg.dropout > 0)
        rows.append({"b": b, "s": s, "measured": saved.bytes, "formula": formula,
                     "layernorm_stats": 2 * s * b * stat_bytes})  # two LayerNorms per block
    return rows


def data_parallel_step(cfg, recipe, rank, batch_size):
    """One step of plain data parallelism with a recipe; returns the state this rank holds."""
    dev = launch.device()
    net = tiny.build(cfg, seed=0, device=dev)  # same seed on every rank: replicas start equal
    opt = precision.prepare(net, recipe)
    x, y = tiny.synthetic_batch(cfg, batch_size, seed=rank, device=dev)  # each rank its own data
    net(x, y).backward()
    with comm.counting() as tally:
        for p in net.parameters():  # the gradient the optimizer will read
            g = p.main_grad if opt.recipe.grad_buffer else p.grad
            comm.all_reduce(g)
            g.div_(torch.distributed.get_world_size())
    opt.step()
    held = memory.state_bytes(net, opt)
    psi = tiny.num_params(net)
    checksum = sum(p.double().sum().item() for p in net.parameters())
    return {"numel": psi, "held": held, "bytes_per_param": held["total"] / psi,
            "formula": precision.recipe(recipe).bytes_per_param(), "allreduce_bytes": tally.bytes_sent,
            "param_checksum": checksum}


def measure(rank, world_size, recipes=tuple(precision.RECIPES), shapes=((1, 8), (2, 8), (2, 16)),
            batch_size=2):
    """The chapter-1 lab, on every rank: bytes per parameter by recipe, activations per block."""
    cfg = tiny.GPTConfig()
    result = {name: data_parallel_step(cfg, name, rank, batch_size) for name in recipes}
    act_cfg = tiny.GPTConfig(dropout=0.1)  # the formula assumes dropout everywhere
    return {"recipes": result, "activations": measure_activations(act_cfg, shapes, device=launch.device()),
            "cuda_peak_bytes": memory.cuda_peak_bytes()}


def state_gb(model, world_size, zero_stage, recipe="mixed"):
    """GB per device of parameters + gradients + optimizer state (no activations), pure data parallel."""
    return state_bytes_per_param(zero_stage, world_size, recipe)["total"] * MODELS[model].params() / GB


# Chapter 1's exercises: the answers are computed here, so the book never types them.
EXERCISES = {
    "1": lambda: state_gb("13B", 8, zero_stage=2),
    "2": lambda: math.ceil(16 * MODELS["70B"].params() / (80 * GB)),
    "3": lambda: activation_bytes_per_layer(2048, 1, 12288, 96) / GB,
    "4": lambda: 80 * GB / 16 / 1e9,
}


def check(question, answer, rel=0.01):
    """Automatic checker: within 1% of the computed answer."""
    return exercises.check(EXERCISES, question, answer, rel)


def main(argv=None):
    from labs import cli
    p = cli.parser("Memory budget per device (calculator: --world-size GPUs, default 8), or --measure "
                   "it on the tiny model (--world-size ranks, default 2).", world_size_default=None)
    p.add_argument("--measure", action="store_true", help="run the lab instead of the calculator")
    p.add_argument("--model", default="7B", choices=list(MODELS))
    p.add_argument("--tp", type=cli.positive_int, default=1)
    p.add_argument("--pp", type=cli.positive_int, default=1)
    p.add_argument("--zero-stage", type=int, default=0, help="0 = plain data parallel, 1, 2 or 3")
    p.add_argument("--recipe", default="mixed", choices=list(precision.RECIPES))
    p.add_argument("--seq", type=cli.positive_int, default=4096)
    p.add_argument("--micro-batch", type=cli.positive_int, default=1)
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="memory per GPU in GB (default 80)")
    args = cli.parse(p, argv)
    if args.world_size is None:
        args.world_size = 2 if args.measure else 8
    if args.measure:
        results = launch.launch(measure, args.world_size, timeout=args.timeout)
        if results is None:
            return
        r0 = results[0]["recipes"]
        result = {"world_size": len(results), "bytes_per_param": {k: v["bytes_per_param"] for k, v in r0.items()},
                  "formula": {k: v["formula"]["total"] for k, v in r0.items()},
                  "replicas_equal": all(r["recipes"] == results[0]["recipes"] for r in results),
                  "activations": results[0]["activations"]}
        lines = [f"{k:18s} measured {v:6.2f} B/param, formula {result['formula'][k]}" for k, v in
                 result["bytes_per_param"].items()]
        cli.report(result, args, "\n".join(lines))
        return
    r = budget(args.model, args.world_size, args.tp, args.pp, args.zero_stage, args.recipe, args.seq,
               args.micro_batch, args.recompute, args.sequence_parallel, args.gpu_gb)
    g = r["gb_per_device"]
    summary = (f"{args.model} ({r['params'] / 1e9:.2f}B params) on {args.world_size} GPUs "
               f"(dp={r['dp']}, tp={args.tp}, pp={args.pp}, ZeRO-{args.zero_stage}): "
               + ", ".join(f"{k} {v:.1f} GB" for k, v in g.items())
               + f" -> {'fits' if r['fits'] else 'does not fit'} in {args.gpu_gb:g} GB")
    cli.report(r, args, summary)


if __name__ == "__main__":
    from labs import cli
    cli.main(main)
