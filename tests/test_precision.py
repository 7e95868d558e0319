"""The hand-built mixed-precision Adam: same update as torch's, and exactly its recipe's bytes."""
import pytest
import torch

from labs.measure import memory
from labs import model
from labs.memory_budget import recipes

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics


def test_hand_adam_matches_torch_adam():
    cfg = model.GPTConfig()
    ours, ref = model.build(cfg, seed=0), model.build(cfg, seed=0)
    opt = recipes.prepare(ours, "fp32", lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = model.synthetic_batch(cfg, 2, seed=step)
        opt.zero_grad()
        ours(x, y).backward()
        # Both optimizers get the same gradients: the key bias has a true gradient of exactly zero
        # (softmax ignores a per-query constant), so its rounding noise would otherwise differ
        # between two models a few ulps apart and Adam would amplify it to a 1e-4 step.
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        # Same formula, different operation order (torch divides sqrt(v) by sqrt(bias2) after the
        # root): a few fp32 ulps per step, far below the 1e-2 steps being taken.
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(recipes.RECIPES))
def test_each_recipe_holds_exactly_its_bytes(name):
    cfg = model.GPTConfig()
    net = model.build(cfg)
    opt = recipes.prepare(net, name)
    x, y = model.synthetic_batch(cfg, 2, seed=0)
    net(x, y).backward()
    opt.step()
    held = memory.state_bytes(net, opt)
    psi = model.num_params(net)
    expected = recipes.recipe(name).bytes_per_param()
    assert {k: v / psi for k, v in held.items()} == expected


def test_fp32_gradient_buffer_accumulates_micro_batches():
    cfg = model.GPTConfig()
    net = model.build(cfg)
    recipes.prepare(net, "mixed_fp32_grads")   # wires the fp32 gradient buffer into net
    xs, ys = model.synthetic_batch(cfg, 4, seed=0)
    for i in range(2):
        net(xs[2 * i:2 * i + 2], ys[2 * i:2 * i + 2]).backward()
    assert all(p.grad is None for p in net.parameters())  # the bf16 grads were freed
    single = model.build(cfg).to(torch.bfloat16)
    for i in range(2):
        single(xs[2 * i:2 * i + 2], ys[2 * i:2 * i + 2]).backward()
    for p, q in zip(net.parameters(), single.parameters()):
        # The buffer sums in fp32; .grad sums in bf16 (8 mantissa bits): agree to bf16 rounding.
        torch.testing.assert_close(p.main_grad, q.grad.float(), rtol=2e-2, atol=1e-3)


def test_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
        recipes.recipe("fp8")
