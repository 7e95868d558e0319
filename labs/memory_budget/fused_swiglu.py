"""Chapter 1, a fused SwiGLU: the MLP activation kept for backward as its two inputs only.

`labs.model.SwiGLU` computes w2(SiLU(x w1) * (x w3)) op by op, and autograd keeps x w1 (for SiLU's
backward), SiLU(x w1) and x w3 (for the product's) and the product (w2's input): 8sbf bytes in bf16,
the "swiglu" term of `activations.llama_activation_terms`. A fused kernel computes SiLU(a) * b in one
op and recomputes SiLU(a) in its backward from the inputs it kept, a and b: Megatron-LM's
``SwiGLUFunction`` (megatron/core/fusions/fused_bias_swiglu.py) saves only its input, the
concatenated [x w1, x w3]. What stays is a, b and w2's input: 6sbf, an elementwise recomputation
that costs no matmul FLOPs. Production Llama-style stacks run such a kernel; chapter 14's planner
counts the MLP this way for them (and the unfused way for the book's own block).
"""
import torch
import torch.nn.functional as F

from labs.measure import memory
from labs.formulas.activations import (  # the formulas' home is the torch-free core
    llama_fused_mlp_terms as llama_fused_mlp_terms, swiglu_saved_bytes as swiglu_saved_bytes)


class FusedSwiGLU(torch.autograd.Function):
    """SiLU(a) * b, keeping a and b for backward and recomputing SiLU(a) there."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        sig = torch.sigmoid(a)                      # recomputed, not stored
        silu = a * sig
        return grad * b * sig * (1 + a * (1 - sig)), grad * silu   # d/da SiLU(a) = sig (1 + a (1 - sig))


def measure(s=8, b=2, h=16, ffn=40, dtype=torch.bfloat16, seed=0):
    """Saved-for-backward bytes of the MLP w2(SwiGLU(x w1, x w3)), fused and op by op, beside
    2sbh (x) + `swiglu_saved_bytes`; and the input gradient of both, which must agree."""
    torch.manual_seed(seed)
    mlp = torch.nn.ModuleDict({"w1": torch.nn.Linear(h, ffn, bias=False),
                               "w3": torch.nn.Linear(h, ffn, bias=False),
                               "w2": torch.nn.Linear(ffn, h, bias=False)}).to(dtype)
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    out = {}
    for name, act in (("fused", FusedSwiGLU.apply), ("unfused", lambda p, q: F.silu(p) * q)):
        with memory.saved_for_backward(mlp) as saved:   # the weights are parameters, not activations
            y = mlp["w2"](act(mlp["w1"](x), mlp["w3"](x)))
        (dx,) = torch.autograd.grad(y.float().sum(), x)
        out[name] = {"measured": saved.bytes, "dx": dx,
                     "formula": x.element_size() * s * b * h
                     + swiglu_saved_bytes(s, b, ffn, fused=name == "fused",
                                                                                 act_bytes=x.element_size())}
    return out


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Saved-for-backward bytes of a SwiGLU MLP, fused and op by op, against the formula "
                   "(one process).", None)
    p.add_argument("--seq", type=cli.positive_int, default=8)
    p.add_argument("--ffn", type=cli.positive_int, default=40)
    args = cli.parse(p, argv)
    if args.world_size not in (None, 1):
        raise ValueError(f"this lab runs on one process; got --world-size {args.world_size}.")
    r = measure(s=args.seq, ffn=args.ffn)
    result = {k: {"measured": v["measured"], "formula": v["formula"]} for k, v in r.items()}
    cli.report(result, args, "\n".join(f"{k}: measured {v['measured']:,} B, formula {v['formula']:,.0f} B"
                                       for k, v in result.items()))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
