"""Mixed-precision Adam, built by hand so every byte it holds is visible (chapters 1, 3 and 8).

The recipe of Micikevicius et al. 2018 ("Mixed Precision Training", arXiv 1710.03740) as the ZeRO
paper (Rajbhandari et al. 2019, arXiv 1910.02054, section 3.1) counts it: the model computes with
16-bit weights and gradients (2 + 2 bytes per parameter) and the optimizer keeps K = 12 bytes of
fp32 state: a master copy of the weights, Adam's first moment m and second moment v. Total 16.

`RECIPES` names the variants the book compares; `prepare` applies one to a model and returns its
optimizer.
"""

import torch

from labs import model as tiny
from labs.measure import memory
from labs.formulas.memory import (  # the formulas' home is the torch-free core
    FP32 as FP32, RECIPES as RECIPES, Recipe as Recipe, recipe as recipe)


class Adam:
    """Adam (Kingma & Ba 2014, arXiv 1412.6980) over a recipe's master weights.

    Same update as ``torch.optim.Adam`` (weight decay off); the step count is a Python int, so the
    state is exactly master + m + v and nothing else.
    """

    def __init__(self, params, recipe, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        self.params = list(params)
        self.recipe, self.lr, self.betas, self.eps = recipe, lr, betas, eps
        self.master = [p.detach().float().clone() if recipe.master else None for p in self.params]
        self.m = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.v = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.t = 0

    def state_dict_tensors(self):
        return [t for t in self.master + self.m + self.v if t is not None]

    @torch.no_grad()
    def step(self):
        self.t += 1
        for p, master, m, v in zip(self.params, self.master, self.m, self.v):
            g = (p.main_grad if self.recipe.grad_buffer else p.grad).float()
            w = master if master is not None else p  # fp32 update, or in place in the working dtype
            adam_update(w, g, m, v, self.t, self.lr, self.betas, self.eps)
            if master is not None:
                p.copy_(master)  # round the new master weights into the working copy

    def zero_grad(self):
        for p in self.params:
            if self.recipe.grad_buffer:
                p.main_grad.zero_()
            if p.grad is not None:
                p.grad = None if not self.recipe.keep_grads else p.grad.zero_()


@torch.no_grad()
def adam_update(w, g, m, v, t, lr, betas=(0.9, 0.999), eps=1e-8):
    """One Adam step on ``w`` in place (m, v updated too); ``t`` counts steps from 1."""
    b1, b2 = betas
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    w.addcdiv_(m, (v / (1 - b2 ** t)).sqrt_().add_(eps), value=-lr / (1 - b1 ** t))


def _accumulate_into_buffer(recipe):
    def hook(p):  # runs once p.grad holds this backward's gradient
        p.main_grad.add_(p.grad)
        if recipe.keep_grads:
            p.grad.zero_()  # the bf16 buffer stays allocated; its contents now live in main_grad
        else:
            p.grad = None
    return hook


def prepare(model, name, lr=1e-3):
    """Cast ``model`` to the recipe's working dtype, attach its gradient buffers, return its Adam."""
    r = recipe(name)
    model.to(getattr(torch, r.weights))    # the core names the dtype; torch makes it
    if r.grad_buffer:
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            p.register_post_accumulate_grad_hook(_accumulate_into_buffer(r))
    return Adam(model.parameters(), r, lr=lr)


def weigh_torch_adam(cls="Adam", cfg=None, batch_size=2):
    """Weigh ``torch.optim.Adam`` (or ``AdamW``) after one step on the tiny GPT in bf16: a measurement.

    torch's Adam keeps no master copy: its ``exp_avg`` and ``exp_avg_sq`` are ``zeros_like(p)``,
    in the parameter's dtype, and ``step`` is one fp32 scalar tensor per parameter tensor
    (torch/optim/adam.py, ``_init_group``, torch 2.13). Returns bytes by kind (`memory.state_bytes`),
    ``numel``, ``tensors`` (parameter tensors) and ``dtypes`` of the state, as torch made them.
    """
    cfg = cfg or tiny.GPTConfig()
    net = tiny.build(cfg, seed=0).to(torch.bfloat16)
    opt = getattr(torch.optim, cls)(net.parameters(), lr=1e-3)
    x, y = tiny.synthetic_batch(cfg, batch_size, seed=0)
    net(x, y).backward()
    opt.step()
    params = list(net.parameters())
    dtypes = sorted({f"{k} {v.dtype}".replace("torch.", "") for s in opt.state.values()
                     for k, v in s.items()})
    by_key = {}  # bytes of the state's storages, by state key, each storage once
    for key in sorted({k for st in opt.state.values() for k in st}):
        storages = {st[key].untyped_storage()._cdata: st[key].untyped_storage().nbytes()
                    for st in opt.state.values()}
        by_key[key] = sum(storages.values())
    return {"held": memory.state_bytes(net, opt), "numel": sum(p.numel() for p in params),
            "tensors": len(params), "dtypes": dtypes, "by_key": by_key}


def torch_adam_step_temporaries(impl, cfg=None):
    """Bytes ``torch.optim.Adam`` allocates during one step beyond what it holds: a measurement.

    On the tiny GPT in fp32 (so m and v are fp32), the second step runs under `memory.PeakMemory`
    (the first creates the state); the temporaries are its peak less its baseline. ``impl``:
    "for-loop" (``foreach=False``, ``_single_tensor_adam``: one parameter tensor at a time),
    "foreach" (``_multi_tensor_adam``, torch's default when every parameter is on a GPU: it computes
    ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)``, one tensor per parameter tensor,
    all alive at once; torch/optim/adam.py, torch 2.13) or "fused" (``fused=True``, one in-place
    operator). Returns {"temporaries", "numel", "largest" (elements of the largest tensor),
    "v_bytes" (the storages of every ``exp_avg_sq``), "loop_count" (what the per-tensor loop should
    allocate, counted from the parameter order: for tensor i, ``exp_avg_sq.sqrt()`` and its quotient
    by the bias correction, 2 n_i, while Python still holds the previous tensor's ``denom``, n_(i-1),
    until the name is rebound; the largest such sum, in fp32 bytes)}.
    """
    if impl not in ("for-loop", "foreach", "fused"):
        raise ValueError(f"impl must be 'for-loop', 'foreach' or 'fused', got {impl!r}.")
    cfg = cfg or tiny.GPTConfig()
    net = tiny.build(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    for p in net.parameters():  # any gradient will do: the step's temporaries depend on shapes only
        p.grad = torch.randn(p.shape, generator=gen)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=impl == "foreach", fused=impl == "fused")
    opt.step()
    with memory.PeakMemory(net, opt) as mem:
        opt.step()
    params = list(net.parameters())
    n = [p.numel() for p in params]
    loop_count = 4 * max(2 * n[i] + (n[i - 1] if i else 0) for i in range(len(n)))
    return {"temporaries": mem.peak_bytes - mem.baseline_bytes, "numel": sum(n), "loop_count": loop_count,
            "largest": max(p.numel() for p in params),
            "v_bytes": sum(st["exp_avg_sq"].untyped_storage().nbytes() for st in opt.state.values())}
