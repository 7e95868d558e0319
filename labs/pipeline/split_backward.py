"""Chapter 5: the backward pass split into B (input gradient) and W (weight gradient).

Qi et al., "Zero Bubble (Almost) Pipeline Parallelism", ICLR 2024 (arXiv 2401.10241), §1 and
Figure 1: a linear layer y = x A^T + b has a backward of two matmuls, dx = dy A (B: the previous
stage waits for it) and dA = dy^T x (W: only the optimizer waits for it). A pipeline that runs W
later can fill its bubbles with it (`labs.formulas.schedules.zb_h1`).

How this lab splits, as the zero-bubble authors' Megatron-LM fork does (``WeightGradStore`` in
megatron/core/weight_grad_store.py of sail-sg/zero-bubble-pipeline-parallelism stores each linear
layer's input and output gradient for W): inside `deferring(module, store)` every ``nn.Linear`` runs
as `_DeferredLinear`, whose backward computes dx only and appends (layer, x, dy) to ``store``. B is
then an ordinary backward without ``retain_graph``: autograd frees every other activation of the
micro-batch as it goes, and between B and W the stage holds only W's inputs, x and dy of each linear
layer (the paper's Table 1: 32sbh bytes per layer in 16-bit, i.e. 16 values per token per h).
`weight_grads(store)` is W: dA += dy^T x and db += sum(dy), nothing recomputed. LayerNorm and
embedding weights get their gradients in B: elementwise work with no matmul, which is all Table 1
counts.

torch.distributed.pipelining splits the same FLOPs differently (``stage_backward_input`` in
torch/distributed/pipelining/_backward.py): B runs autograd with ``retain_graph=True`` and catches
the gradients arriving at the nodes that feed the weights; W runs autograd from those nodes to the
weights. No matmul is done twice, but the whole graph, every activation included, lives until W.

`Activations` measures what a stage holds for backward, and `measure` counts the FLOPs of F, B, W
and of the unsplit backward with ``torch.utils.flop_counter.FlopCounterMode``.
"""
import contextlib
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from labs.measure import memory
from labs import model as tiny


class _DeferredLinear(torch.autograd.Function):
    """y = x A^T + b whose backward (B) returns dx only and leaves (layer, x, dy) for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, store):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.store = layer, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        ctx.store.append((ctx.layer, x, dy))   # all W needs: the layer's input and output gradient
        dx = dy @ weight if ctx.needs_input_grad[0] else None                # dx = dy A
        return dx, None, None, None, None      # no weight or bias gradient in B


def _deferred_forward(layer, store, x):
    return _DeferredLinear.apply(x, layer.weight, layer.bias, layer, store)


@contextlib.contextmanager
def deferring(module, store):
    """Forwards run inside the block leave their linear layers' weight gradients in ``store``."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    for layer in linears:
        layer.forward = lambda x, layer=layer: _deferred_forward(layer, store, x)
    try:
        yield store
    finally:
        for layer in linears:
            del layer.forward                 # back to nn.Linear.forward


def _accumulate(param, grad):
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def weight_grads(store):
    """W: the weight gradients B left in ``store``, one matmul per linear layer."""
    for layer, x, dy in store:
        if not layer.weight.requires_grad:   # frozen
            continue
        x2, dy2 = x.reshape(-1, x.size(-1)), dy.reshape(-1, dy.size(-1))   # (N, in), (N, out)
        _accumulate(layer.weight, dy2.t() @ x2)                             # dA = dy^T x, (out, in)
        if layer.bias is not None:
            _accumulate(layer.bias, dy2.sum(0))
    store.clear()


class _Held:
    """What autograd keeps in its graph in place of a saved tensor: a weak reference to this
    holder tells whether the graph still holds the tensor."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class Activations:
    """Bytes of activations a stage holds for backward, measured by liveness, not by formula.

    Inside `saving()`, every tensor autograd saves is packed into a `_Held` that the graph owns;
    backward without ``retain_graph`` drops each holder once its node has run. `held_bytes` adds the
    distinct storages of the tensors still held and of the (x, dy) pairs waiting in W stores.
    Parameters are left out: they are counted as parameters, not activations.
    """

    def __init__(self, modules):
        self.params = set()   # storages of parameters and buffers, filled in by storage_bytes
        memory.storage_bytes([t for m in modules for t in [*m.parameters(), *m.buffers()]], self.params)
        self.holders = []

    def _pack(self, t):
        held = _Held(t)
        self.holders.append(weakref.ref(held))
        return held

    def saving(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.t)

    def held_bytes(self, stores=()):
        self.holders = [h for h in self.holders if h() is not None]
        tensors = [h().t for h in self.holders] + [t for store in stores for _, x, dy in store
                                                   for t in (x, dy)]
        return memory.storage_bytes(tensors, seen=set(self.params))


class _Flops:
    """Runs a call under FlopCounterMode and keeps its count, or just runs it: the counter's first
    use in a process imports for about 1.5 s, which a pipeline worker need not pay."""

    def __init__(self, on):
        self.on, self.counts = on, {}

    def __call__(self, name, fn, *args):
        if not self.on:
            return fn(*args)
        with FlopCounterMode(display=False) as counter:
            value = fn(*args)
        self.counts["flops_" + name] = counter.get_total_flops()
        return value


def measure(module, args, grad=None, count_flops=True):
    """One micro-batch through ``module``: activation bytes and FLOPs of F, B and W.

    activation_bytes_F: what the forward leaves for backward (held until B); activation_bytes_W:
    what a split B leaves for W (held until W); both measured by `Activations`. With count_flops,
    also flops_forward, flops_backward_full (the unsplit backward), flops_backward_input (B) and
    flops_backward_weight (W), counted by FlopCounterMode (matmuls). Gradients accumulate into
    ``module``'s parameters: zero them afterwards.
    """
    flops, acts, store = _Flops(count_flops), Activations([module]), []
    if count_flops:
        flops("backward_full", torch.autograd.backward, module(*args), grad)
    with deferring(module, store), acts.saving():
        out = flops("forward", module, *args)
    held_f = acts.held_bytes()
    flops("backward_input", torch.autograd.backward, out, grad)
    held_w = acts.held_bytes([store])
    flops("backward_weight", weight_grads, store)
    return flops.counts | {"activation_bytes_F": held_f, "activation_bytes_W": held_w}


def costs(cfg, batch_size=2):
    """FLOPs (FlopCounterMode) and activation bytes of F, B and W for one micro-batch, in this
    process: for one layer, beside Qi et al.'s Table 1 (``table_1``: matmul FLOPs per layer and
    W's bytes), and for the whole model ``tiny.build(cfg)``, embeddings and head included.

    layer, model: `measure` dicts. flops_split_error: |B + W - full backward| / full backward for
    the whole model; 0 when W recomputes nothing (the same matmuls, counted in integers).
    """
    s, b, h = cfg.seq_len, batch_size, cfg.hidden
    net = tiny.build(cfg, seed=0)
    x = torch.randn(b, s, h, requires_grad=True)                       # a layer's input, (B, T, H)
    layer = measure(net.blocks[0], (x,), torch.randn_like(x))
    model = measure(net, tiny.synthetic_batch(cfg, batch_size, seed=0))
    table_1 = {"flops_forward": s * b * h * (24 * h + 4 * s),
               "flops_backward_input": s * b * h * (24 * h + 8 * s),
               "flops_backward_weight": s * b * h * 24 * h,
               # 32sbh bytes in 16-bit: 16 values per token and h; fp32 here
               "activation_bytes_W": 32 * s * b * h * 2}
    error = abs(model["flops_backward_input"] + model["flops_backward_weight"] - model["flops_backward_full"])
    return {"layer": layer, "model": model, "table_1": table_1,
            "flops_split_error": error / model["flops_backward_full"]}
