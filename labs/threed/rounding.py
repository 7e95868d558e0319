"""Chapter 17: how far two runs that add the same numbers in another order can be apart, op by op.

A layout computes what one process computes; only the order of its floating-point sums changes
(a row-parallel matmul adds tp partial sums, context parallelism attends block by block, data
parallelism adds the replicas' gradients around a ring). Context parallelism's blockwise softmax also
runs other operations (a log-sum-exp merge); it is charged here as one process's softmax, an omission
`drift` lists. A sum of K terms computed in any order
is within gamma_K * sum |terms| of the exact sum, gamma_K = K u / (1 - K u), u the unit roundoff
(Higham 2002, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1, the bound
that holds for every order of evaluation); two orders are within twice that of each other.

`Rounding` watches one process's forward and backward (a TorchFunctionMode, so the model stays
untouched) and adds up, per kind of op a layout may reorder, the first-order effect of that bound
on the loss L, weighting each output's bound by |dL/dy| from backward:
    linear y = x W^T + b (inner length K):  2 gamma_{K+1} <|dL/dy|, |x| |W|^T + |b|>
    attention matmul A B (inner length K):   2 gamma_K <|dL/dy|, |A| |B|>
    softmax over T keys:                     2 gamma_T <|dL/dp|, p>
    mean cross entropy over n tokens:        2 gamma_n l |dL/dl|     (its terms are >= 0)
and, for every parameter, its gradient recomputed with every term's absolute value (|dY|^T |X|
for a linear weight, sum |dY| for a bias, sum |dY * xhat| for a LayerNorm weight, the rows of
|dY| for an embedding): the gradient's own rounding bound is 2 gamma_N times that, N the tokens
whose terms it adds. Elementwise ops (GeLU, residual adds, LayerNorm over its h features) run
the same operations on every layout, so they add nothing of their own.
"""
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
KINDS = ("block", "head", "attention", "softmax", "loss")
# the block linears whose outputs tensor parallelism adds up across ranks (Megatron's g, chapter 4)
ROW_PARALLEL = ("attn.proj.weight", "mlp.proj.weight")


def gamma(k, u):
    """gamma_k = k u / (1 - k u) (Higham 3.1: an inner product of k terms; a plain sum of k terms needs
    gamma_(k-1)); inf once k u >= 1, where gamma is undefined (for 256 bf16 terms the bound that
    always holds, (1 + u)^k - 1, is about 1.7: no useful bound)."""
    return k * u / (1 - k * u) if k * u < 1 else float("inf")


class Rounding(TorchFunctionMode):
    """First-order rounding bounds of one process's steps: ``forward[kind]`` (on the loss) and
    ``absgrad[name]`` (per parameter, the gradient with absolute terms), summed over the backward
    passes run inside. ``u``: the unit roundoff of the sums (fp32 2^-24, bf16 2^-8)."""

    def __init__(self, model, u=2.0 ** -24):
        super().__init__()
        self.u, self.head = u, id(model.head.weight)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.forward = defaultdict(float)
        self.absgrad = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        # <|dL/dy|, |x| |W|^T + |b|> over the row-parallel linears alone (no gamma): what tensor
        # parallelism's g adds as tp partial sums, for a collective that sums in another precision
        self.row_parallel = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return out
        if func is F.linear:
            self._linear(out, *args, **kwargs)
        elif func in MATMULS:
            self._matmul(out, *args)
        elif func is torch.Tensor.softmax:
            self._softmax(out)
        elif func is F.cross_entropy:
            self._loss(out, args[0])
        elif func is F.layer_norm:
            self._layer_norm(out, *args, **kwargs)
        elif func is F.embedding:
            self._embedding(out, *args)
        return out

    def _add(self, param, value):
        if param is not None and id(param) in self.names:
            self.absgrad[self.names[id(param)]] += value

    def _linear(self, out, x, weight, bias=None):
        ax, aw = x.detach().abs(), weight.detach().abs()
        ab = bias.detach().abs() if bias is not None else None
        bound = F.linear(ax, aw, ab)                               # |x| |W|^T + |b|, like y
        g = 2 * gamma(x.shape[-1] + (bias is not None), self.u)
        kind = "head" if id(weight) == self.head else "block"
        row = self.names.get(id(weight), "").endswith(ROW_PARALLEL)

        def hook(grad):
            ag = grad.detach().abs()
            magnitude = (ag * bound).sum().item()
            self.forward[kind] += g * magnitude
            self.row_parallel += magnitude if row else 0.0
            rows, cols = ag.reshape(-1, ag.shape[-1]), ax.reshape(-1, ax.shape[-1])
            self._add(weight, rows.T @ cols)                       # (out, in): sum over tokens
            self._add(bias, rows.sum(0))
        out.register_hook(hook)

    def _matmul(self, out, a, b):
        bound = a.detach().abs() @ b.detach().abs()
        g = 2 * gamma(a.shape[-1], self.u)
        out.register_hook(lambda grad: self._count("attention", g * (grad.detach().abs()
                                                                     * bound).sum().item()))

    def _softmax(self, p):
        g, kept = 2 * gamma(p.shape[-1], self.u), p.detach()
        p.register_hook(lambda grad: self._count("softmax", g * (grad.detach().abs() * kept).sum().item()))

    def _loss(self, out, logits):
        n, g = logits.reshape(-1, logits.shape[-1]).shape[0], out.detach()
        out.register_hook(lambda grad: self._count("loss", 2 * gamma(n, self.u) * (g * grad.abs()).item()))

    def _layer_norm(self, out, x, shape, weight=None, bias=None, eps=1e-5):
        xhat = F.layer_norm(x.detach(), shape, eps=eps).abs()

        def hook(grad):
            ag = grad.detach().abs()
            self._add(weight, (ag * xhat).reshape(-1, ag.shape[-1]).sum(0))
            self._add(bias, ag.reshape(-1, ag.shape[-1]).sum(0))
        out.register_hook(hook)

    def _embedding(self, out, idx, weight, *rest, **kwargs):
        def hook(grad):
            rows = torch.zeros_like(weight, requires_grad=False)
            rows.index_add_(0, idx.reshape(-1), grad.detach().abs().reshape(-1, weight.shape[-1]))
            self._add(weight, rows)
        out.register_hook(hook)

    def _count(self, kind, value):
        self.forward[kind] += value
