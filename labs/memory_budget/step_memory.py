"""Memory over training steps, by kind, and activations against sequence length (chapter 1).

`step_timeline` runs training steps of the tiny GPT with the mixed-precision recipe under
`labs.measure.memory.PeakMemory` (the book's live-storage high-water mark) and records, after every
ATen operator, the live bytes of each kind: the bf16 weights, the gradients, the optimizer's fp32
state (master copy, Adam's m and v) and everything else (activations and the step's temporaries).
The optimizer is built when the first step runs, as ``torch.optim.Adam`` creates its state lazily
(its contents are the recipe's: fp32 master, m and v; torch's own Adam keeps m and v in the weights'
dtype and no master copy, `recipes.weigh_torch_adam`). Between steps the gradients are zeroed in
place (the `mixed` recipe keeps its buffers, ``zero_grad(set_to_none=False)``) or, with
``set_to_none=True``, freed as ``torch.optim``'s ``zero_grad`` does by default since torch 2.0.

`crossover_seq` is a formula: the sequence length at which a Llama model's activations (all L
layers, micro-batch 1) pass its 16-byte model state.
"""
import itertools

import torch

from labs import model as tiny
from labs.formulas.memory import model_activations
from labs.formulas.shape import ModelShape
from labs.measure import memory
from labs.memory_budget import recipes

# Llama Team 2024 (arXiv 2407.21783), Table 3: 8B and 70B shapes, 8 KV heads, a vocabulary of
# 128K (Table 3 prints 128,000); V = 128,256 is the released config's vocab_size.
LLAMA3 = {
    "Llama 3 8B": ModelShape("Llama 3 8B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                             vocab=128256, seq=8192),
    "Llama 3 70B": ModelShape("Llama 3 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                              vocab=128256, seq=8192),
}


class _Lifetimes(memory.PeakMemory):
    """`PeakMemory` that also keeps each allocation's [first, last + 1) operator index and size."""

    def __init__(self, *external):
        super().__init__(*external, timeline=True)
        self.spans, self._open = [], {}

    def _track(self, storage, baseline):
        new = storage._cdata not in self.live
        super()._track(storage, baseline)
        if new and not baseline:
            span = [storage._cdata, len(self.timeline), None, storage.nbytes()]
            self.spans.append(span)
            self._open[storage._cdata] = span

    def _freed(self, key):
        span = self._open.pop(key, None)
        if span is not None and self._active:
            span[2] = len(self.timeline)
        super()._freed(key)


def step_timeline(steps=2, batch_size=8, recipe="mixed", cfg=None, set_to_none=False):
    """Live bytes by kind after every operator of ``steps`` training steps, and the phase marks.

    Returns {"weights", "gradients", "optimizer_state", "other"}: lists, one value per operator
    (weights: the parameters' storages; other: activations, temporaries, the batch, the buffers);
    "phases": [(name, first operator index)]; "peak_bytes" (PeakMemory's own high-water mark) and
    "peak_index" (where the curve reaches it); "numel"; "end": bytes per parameter of each kind when
    the last step ends. ``set_to_none``: free the gradients between steps instead of zeroing them.
    """
    cfg = cfg or tiny.GPTConfig()
    net = tiny.build(cfg, seed=0)
    r = recipes.recipe(recipe)
    net.to(getattr(torch, r.weights))
    phases, opt = [], None
    with _Lifetimes(net) as mem:
        x, y = tiny.synthetic_batch(cfg, batch_size, seed=0)
        for step in range(1, steps + 1):
            phases.append((f"forward {step}", len(mem.timeline)))
            loss = net(x, y)
            phases.append((f"backward {step}", len(mem.timeline)))
            loss.backward()
            del loss
            phases.append((f"optimizer {step}", len(mem.timeline)))
            if opt is None:  # created at the first step, as torch.optim.Adam does
                opt = recipes.Adam(net.parameters(), r)
            opt.step()
            if step < steps and not set_to_none:
                opt.zero_grad()  # in place: the gradient storages stay allocated
            elif step < steps:
                for p in net.parameters():  # mark them gradients before they are freed
                    mem._open[p.grad.untyped_storage()._cdata].append("gradients")
                    p.grad = None
        grads = {p.grad.untyped_storage()._cdata for p in net.parameters()}
        state = {t.untyped_storage()._cdata for t in opt.state_dict_tensors()}
        n = len(mem.timeline)
        kinds = {k: [0] * n for k in ("gradients", "optimizer_state", "other")}
        for key, first, last, nbytes, *tag in mem.spans:
            # a storage alive at the end is classified by what holds it then; keys of freed
            # storages may have been reused, so they are never looked up (freed gradients are
            # tagged when they are freed)
            kind = (tag[0] if tag else "other" if last is not None else "gradients" if key in grads
                    else "optimizer_state" if key in state else "other")
            kinds[kind][first] += nbytes  # differences here, summed below
            if last is not None and last < n:
                kinds[kind][last] -= nbytes
        baseline = mem.baseline_bytes
    for k, diff in kinds.items():
        kinds[k] = list(itertools.accumulate(diff))
    weights = sum(p.untyped_storage().nbytes() for p in net.parameters())
    kinds["other"] = [v + baseline - weights for v in kinds["other"]]  # buffers: baseline too
    total = [weights + sum(k[i] for k in kinds.values()) for i in range(n)]
    assert total == [baseline + t for t in mem.timeline], "the kinds must add up to the live bytes"
    numel = tiny.num_params(net)
    return {"weights": [weights] * n, **kinds, "phases": phases, "numel": numel,
            "peak_bytes": mem.peak_bytes, "curve_peak_bytes": max(total),
            "peak_index": total.index(max(total)), "ops": n,
            "peak_indices": [i for i, v in enumerate(total) if v == max(total)],  # ties are exact bytes
            "end": {"weights": weights / numel, **{k: v[-1] / numel for k, v in kinds.items()}}}


def crossover_seq(shape, attention="flash", recompute="none", lo=1, hi=1 << 22):
    """The shortest s (tokens, micro-batch 1) at which ``shape``'s activations over all L layers
    reach its 16-byte model state, 16 Psi; a formula (bisection on the Llama activation formula)."""
    state = 16 * shape.params()
    acts = lambda s: model_activations(shape, s, 1, recompute=recompute, attention=attention)["total_bytes"]
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if acts(mid) < state else (lo, mid)
    return lo
