"""Chapter 4: when tensor parallelism stops paying, the communication/compute condition per layer.

The book's own derivation, after the argument of Austin et al., "How to Scale Your Model" (2025):
per layer, TP's communication is a fixed number of activation-sized collectives while its compute
shrinks as 1/tp; once T_comm exceeds T_math no overlap can hide it. (Their Part 5 derives the TPU
version for the MLP alone; Part 12, "How to Think About GPUs", the GPU one, Y < F W / C in their
symbols, F the MLP width.) Written for the Megatron layer of `labs.tensor_parallel.blocks`
(Shoeybi et al. 2019, §3), forward pass, e bytes per element:

    T_comm = 2 all-reduces x 2(tp-1)/tp x b s h e / W          (W the ring's one-direction
                                                                 bandwidth per GPU, `ring_bandwidth`)
    T_math = (2 P_layer b s + 4 b s^2 h) / (tp F_peak)              (F_peak the device's peak FLOP/s)

    T_comm / T_math = 2 (tp-1) h e F_peak / (W (P_layer + 2 s h))     (`ratio`)

b cancels: a bigger micro-batch does not help, because the messages grow with it. With
P_layer ~ 12 h^2 and s << h, the ratio is (tp-1) F_peak / (3 h W) for e = 2: it grows with tp, falls
with h and with the link bandwidth. The crossover, T_comm = T_math, is

    tp* = 1 + W (P_layer + 2 s h) / (2 e h F_peak)  ~  1 + 3 h W / F_peak    (`crossover_tp`)

A training step adds the backward: 2 more all-reduces (f's) and twice the forward FLOPs, so the
step's ratio is 2/3 of the forward's. Layer sizes and hardware figures are those of
`labs.tensor_parallel.blocks.layer_costs` (which this file reuses) and `labs.memory_budget.budget`.
Across nodes W is not one NIC's 50 GB/s: see `labs.formulas.links.ring_bandwidth`.

    python -m labs.tensor_parallel.tp_limits --model 70B --json
"""
import contextlib

import torch
from torch.utils.flop_counter import FlopCounterMode

from labs.formulas.links import ring_bandwidth  # chapter 4's W, one home: labs.formulas
from labs.memory_budget import budget
from labs.launcher import launch
from labs import model as tiny
from labs.tensor_parallel import blocks as tpl, megatron

NVLINK, INFINIBAND = "NVLink 4 (H100)", "InfiniBand NDR (400 Gb/s)"
TWO_NODES = tpl.TWO_NODES    # the ring of tp = 16 over two 8-GPU nodes
DEVICE = "H100 SXM, bf16 dense"


def ratio(h, tp, bandwidth, peak_flops, seq=4096, layer_params=None, bytes_per_elem=2):
    """T_comm / T_math for one layer's forward, closed form; P_layer defaults to the GPT block's 12 h^2."""
    if tp < 1 or h < 1 or bandwidth <= 0 or peak_flops <= 0:
        raise ValueError(f"need tp >= 1, h >= 1 and positive bandwidth and peak FLOP/s, got tp={tp}, h={h}, "
                         f"bandwidth={bandwidth}, peak_flops={peak_flops}.")
    p = 12 * h * h if layer_params is None else layer_params
    return 2 * (tp - 1) * h * bytes_per_elem * peak_flops / (bandwidth * (p + 2 * seq * h))


def crossover_tp(h, bandwidth, peak_flops, seq=4096, layer_params=None, bytes_per_elem=2, step=False):
    """tp* where T_comm = T_math (forward, or the whole step with ``step``: ratio x 2/3)."""
    per_tp = ratio(h, 2, bandwidth, peak_flops, seq, layer_params, bytes_per_elem)  # the ratio at tp - 1 = 1
    return 1 + 1 / (per_tp * (2 / 3 if step else 1))


def condition(model="70B", links=(NVLINK, TWO_NODES, INFINIBAND), tps=(1, 2, 4, 8, 16, 32, 64), seq=4096,
              micro_batch=1,
              device=DEVICE):
    """Per link: one row per tp (comm_s, compute_s, ratio, ratio_step from `layer_costs`), the crossover
    tp* (forward and step) and ``first_comm_bound_tp``, the first tp in ``tps`` whose forward ratio >= 1.
    Each link's W is held fixed at every tp: tp* is the crossover *if* W stayed at that figure (NVLink's
    for one node, full 8-GPU nodes' egress for two nodes, one NIC's for a GPU per node). For the W a
    given placement of the ranks gets, see `layout_ratios`."""
    arch = budget.MODELS[model] if model in budget.MODELS else None
    if arch is None:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(budget.MODELS)}.")
    out = {"model": model, "hidden": arch.hidden, "layer_params": arch.layer_params(), "seq": seq,
           "micro_batch": micro_batch, "device": device, "links": {}}
    for link in links:
        rows = []
        for tp in tps:
            c = tpl.layer_costs(model, tp, seq, micro_batch, link, device)
            r = c["comm_s"] / c["compute_s"]
            rows.append({"tp": tp, "comm_s": c["comm_s"], "compute_s": c["compute_s"], "ratio": r,
                         "ratio_step": r * 2 / 3})
        args = (arch.hidden, budget.LINKS[link], budget.PEAK_FLOPS[device], seq, arch.layer_params())
        out["links"][link] = {"bandwidth": budget.LINKS[link], "rows": rows,
                              "crossover_tp": crossover_tp(*args),
                              "crossover_tp_step": crossover_tp(*args, step=True),
                              "first_comm_bound_tp": next((r["tp"] for r in rows if r["ratio"] >= 1), None)}
    return out


# Where the tp ranks sit, per layout: (nodes, GPUs per node) at each tp, the W of `ring_bandwidth`.
LAYOUTS = {
    "one node, NVLink": lambda tp: (1, tp) if tp <= 8 else None,
    "two nodes, tp/2 GPUs each": lambda tp: (2, tp // 2) if 2 <= tp <= 16 else None,
    "tp/8 full nodes": lambda tp: (tp // 8, 8) if tp >= 16 else None,
    "one GPU per node": lambda tp: (tp, 1) if tp >= 2 else None,
}


def layout_ratios(model="70B", tps=(2, 4, 8, 16, 32, 64), seq=4096, device=DEVICE):
    """Per layout of `LAYOUTS`: for each tp that layout can hold, W = `ring_bandwidth` (nodes, GPUs
    per node) and the forward ratio at that W. `condition` instead holds each link's W fixed at
    every tp; this is the W the ranks actually get where they sit (two nodes at tp = 8: 4 NICs each,
    200 GB/s, not the 400 GB/s of full nodes)."""
    arch = budget.MODELS[model]
    out = {}
    for name, where in LAYOUTS.items():
        rows = []
        for tp in tps:
            if where(tp) is None:
                continue
            w = ring_bandwidth(*where(tp))
            rows.append({"tp": tp, "nodes": where(tp)[0], "bandwidth": w,
                         "ratio": ratio(arch.hidden, tp, w, budget.PEAK_FLOPS[device], seq,
                                        arch.layer_params())})
        out[name] = rows
    return out


def crossover_table(models=("7B", "13B", "70B", "405B"), links=(NVLINK, TWO_NODES, INFINIBAND), seq=4096,
                    device=DEVICE):
    """tp* for each model and link: how h moves the crossover (it grows about as 3 h W / F_peak)."""
    return [{"model": m, "hidden": budget.MODELS[m].hidden,
             **{link: crossover_tp(budget.MODELS[m].hidden, budget.LINKS[link], budget.PEAK_FLOPS[device],
                                   seq, budget.MODELS[m].layer_params()) for link in links}} for m in models]


def measure_layer(rank, world_size, b=2, s=8, hidden=48):
    """The tiny GPT layer under TP, forward: FLOPs counted (FlopCounterMode) beside the closed form's
    (2 * 12 h^2 b s + 4 b s^2 h) / tp, and the all-reduce payloads read from the tensors g hands the
    collective. Ranks other than 0 return only their payloads."""
    cfg = tpl.config(hidden=hidden, n_layer=1)
    megatron.check_degree(cfg, world_size)
    block = megatron.apply_tensor_parallel(tiny.build(cfg, seed=0, device=launch.device())).blocks[0]
    x = torch.randn(b, s, hidden, generator=torch.Generator().manual_seed(1)).to(launch.device())
    # counted on rank 0 only: the counter's first use costs about 1 s of CPU per process, and every
    # rank's layer has the same shapes (the other ranks just run it, for the collectives)
    counter = FlopCounterMode(display=False) if rank == 0 else contextlib.nullcontext()
    with counter, megatron.payloads() as log:
        block(x)
    if rank:
        return {"payloads": [c["bytes"] for c in log]}
    matmul_weights = 12 * hidden * hidden                            # qkv 3h^2, proj h^2, fc 4h^2, proj 4h^2
    return {"flops": counter.get_total_flops(),
            "flops_formula": (2 * matmul_weights * b * s + 4 * b * s * s * hidden) // world_size,
            "payloads": [c["bytes"] for c in log], "element_size": x.element_size()}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Tensor parallelism's communication over compute per layer, NVLink vs InfiniBand.",
                   world_size_default=None)
    p.add_argument("--model", choices=tuple(budget.MODELS), default="70B")
    p.add_argument("--seq", type=cli.positive_int, default=4096)
    p.add_argument("--micro-batch", type=cli.positive_int, default=1)
    args = cli.parse(p, argv)
    r = condition(args.model, seq=args.seq, micro_batch=args.micro_batch)
    lines = [f"{link}: tp* = {v['crossover_tp']:.1f} (step {v['crossover_tp_step']:.1f}); ratio at tp = 8: "
             f"{next(x['ratio'] for x in v['rows'] if x['tp'] == 8):.2f}" for link, v in r["links"].items()]
    cli.report(r, args, f"{args.model}, one layer's forward: " + "; ".join(lines))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
