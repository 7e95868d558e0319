"""The tiny model and the byte accounting every chapter relies on."""
import pytest
import torch

from labs import memory, model


def test_model_runs_and_is_reproducible():
    cfg = model.GPTConfig()
    x, y = model.synthetic_batch(cfg, 2, seed=0)
    a, b = model.build(cfg, seed=1), model.build(cfg, seed=1)
    assert model.build(cfg, seed=2).head.weight.ne(a.head.weight).any()
    torch.testing.assert_close(a(x, y), b(x, y), rtol=0, atol=0)
    assert a(x).shape == (2, cfg.seq_len, cfg.vocab_size)


def test_bad_model_shapes_are_refused():
    with pytest.raises(ValueError, match="not divisible by n_head"):
        model.GPTConfig(hidden=30, n_head=4)
    cfg = model.GPTConfig(seq_len=8)
    with pytest.raises(ValueError, match="longer than seq_len=8"):
        model.build(cfg)(torch.zeros(1, 9, dtype=torch.long))


def test_storage_bytes_count_each_storage_once():
    flat = torch.zeros(100)
    views = [flat[:40], flat[40:], flat.view(10, 10)]
    assert memory.storage_bytes(views) == 400
    assert memory.storage_bytes([torch.zeros(3, dtype=torch.bfloat16), None]) == 6


def test_state_bytes_do_not_count_a_tensor_twice():
    net = torch.nn.Linear(4, 4)
    net(torch.randn(2, 4)).sum().backward()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    held = memory.state_bytes(net, opt)
    assert held == {"parameters": 80, "gradients": 80, "optimizer_state": 80, "total": 240}


def test_saved_for_backward_leaves_parameters_out():
    lin = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(3, 8, requires_grad=True)
    with memory.saved_for_backward(lin) as saved:
        lin(x)
    assert saved.bytes == x.numel() * 4  # the input is saved; the weight is a parameter, not counted
