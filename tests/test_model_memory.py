"""The tiny model every chapter relies on (its byte accounting is tested in test_memory.py)."""
import pytest
import torch

from labs import model

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics


def test_model_runs_and_is_reproducible():
    cfg = model.GPTConfig()
    x, y = model.synthetic_batch(cfg, 2, seed=0)
    a, b = model.build(cfg, seed=1), model.build(cfg, seed=1)
    assert model.build(cfg, seed=2).head.weight.ne(a.head.weight).any()
    torch.testing.assert_close(a(x, y), b(x, y), rtol=0, atol=0)   # the same operations on the same shapes
    assert a(x).shape == (2, cfg.seq_len, cfg.vocab_size)


def test_bad_model_shapes_are_refused():
    with pytest.raises(ValueError, match="not divisible by n_head"):
        model.GPTConfig(hidden=30, n_head=4)
    cfg = model.GPTConfig(seq_len=8)
    with pytest.raises(ValueError, match="longer than seq_len=8"):
        model.build(cfg)(torch.zeros(1, 9, dtype=torch.long))


def _llama_pair(**kw):
    """The same weights under SDPA and with the scores written out."""
    blocks = []
    for attention in ("sdpa", "materialized"):
        torch.manual_seed(0)
        blocks.append(model.LlamaBlock(model.LlamaConfig(attention=attention, **kw)).double())
    return blocks


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_llama_attention_kinds_compute_the_same_block(kv_heads):
    # fp64: the two paths differ only in summation order (~1e-16); a wrong GQA head mapping (K/V head
    # j serving query heads other than j*a/k ... (j+1)*a/k - 1) or a missing mask errs by order 1
    sdpa, mat = _llama_pair(n_kv_head=kv_heads)
    x = torch.randn(2, 12, 32, dtype=torch.double)
    outs, grads = [], []
    for block in (sdpa, mat):
        xi = x.clone().requires_grad_()
        out = block(xi)
        out.square().sum().backward()
        outs.append(out)
        grads.append([xi.grad] + [p.grad for p in block.parameters()])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, rtol=0, atol=1e-10)
    # causal: the first token's output cannot depend on the last token. Exact: the same kernels on
    # the same shapes, and a masked score contributes exp(-inf) = 0 exactly
    y = sdpa(torch.cat([x[:, :-1], x[:, -1:] + 1], dim=1))
    torch.testing.assert_close(y[:, 0], outs[0][:, 0], rtol=0, atol=0)


def test_fused_rmsnorm_backward_is_the_gradient_of_its_forward():
    norm = model.RMSNorm(6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 6))
    x = torch.randn(3, 4, 6, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, w: model._RMSNormFn.apply(t, w, 1e-5), (x, norm.weight))
    # and the forward is Llama's: x / sqrt(mean(x^2) + eps) * w
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), ref, rtol=0, atol=1e-14)


def test_bad_llama_shapes_are_refused():
    with pytest.raises(ValueError, match="n_kv_head must divide n_head"):
        model.LlamaConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="attention must be 'sdpa' or 'materialized'"):
        model.LlamaConfig(attention="flash")
    with pytest.raises(ValueError, match="head size 3 must be even"):
        model.LlamaConfig(hidden=12, n_head=4, n_kv_head=2)
    block = model.LlamaBlock(model.LlamaConfig(seq_len=8))
    with pytest.raises(ValueError, match="longer than seq_len=8"):
        block(torch.zeros(1, 9, 32))
