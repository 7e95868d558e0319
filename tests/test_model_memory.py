"""The tiny model every chapter relies on (its byte accounting is tested in test_memory.py)."""
import pytest
import torch

from labs import model


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
