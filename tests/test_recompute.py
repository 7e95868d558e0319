"""Chapter 9: recomputation policies keep the bytes and cost the FLOPs the formulas say, and leave the
gradients unchanged; gradient accumulation equals the full batch and no_sync divides the all-reduces."""
import json

import pytest
import torch

from labs.data_parallel import loss_reduction
from labs import model as tiny
from labs.recompute import policies as rc

# compares floating-point results: `make test` runs it again under another CPU's rounding
pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def rows():
    return {"default": rc.compare(), "other": rc.compare(rc.config(layers=3, seq=32), batch=1, k=3)}


@pytest.mark.parametrize("shape", ["default", "other"])
def test_every_policy_measures_its_formula(rows, shape):
    for policy, r in rows[shape].items():
        assert r["activation_bytes"] == r["formula_bytes"], policy        # live storages, exact
        assert r["forward_flops"] == r["formula_flops"]["forward"], policy
        assert r["backward_flops"] == r["formula_flops"]["backward"], policy
        # a recomputation reruns the same CPU kernels on the same inputs in the same order: the
        # gradients are the same bits, so any difference at all would be a recomputation bug
        assert r["max_grad_diff_vs_none"] == 0.0, policy   # the same kernels rerun: bit for bit
    r = rows[shape]
    assert r["full"]["flops_ratio_vs_none"] == pytest.approx(4 / 3, abs=1e-12)   # one extra forward, not 2x
    assert r["every-k"]["flops"] == r["full"]["flops"]
    assert r["selective"]["flops"] < r["full"]["flops"]
    # Chen et al.: segments keep fewer inputs than full, and pay for it with a higher peak in backward
    assert r["every-k"]["activation_bytes"] < r["full"]["activation_bytes"]
    assert r["every-k"]["peak_bytes"] > r["full"]["peak_bytes"]


def test_a_policy_that_also_saves_the_softmax_is_caught(monkeypatch):
    """The plausible bug: the softmax kept, so the s x s scores stay; the measurement shows exactly them."""
    monkeypatch.setattr(rc, "SAVED_OPS", rc.SAVED_OPS | {torch.ops.aten._softmax.default})
    cfg, b = rc.config(), 2
    r = rc.measure("selective", cfg, b)
    assert r["activation_bytes"] - r["formula_bytes"] == cfg.n_layer * 2 * cfg.n_head * cfg.seq_len ** 2 * b


def test_saved_tensor_hooks_do_not_see_the_policy_cache():
    """Why the lab reads live storages: saved-tensor hooks see the checkpoints' inputs and nothing of
    what the selective policy caches, so they would report "selective" as cheap as "full"."""
    from labs.measure import memory
    cfg = rc.config()
    blocks, x, run = rc._step(cfg, 2, "selective", 2, torch.bfloat16)
    with memory.saved_for_backward() as saved:
        run(x).sum()
    assert saved.bytes == rc.formula_bytes("full", cfg, 2) < rc.formula_bytes("selective", cfg, 2)


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="k=3 must divide the 4 layers"):
        rc.apply_policy([None] * 4, "every-k", 3)
    with pytest.raises(ValueError, match="policy must be one of"):
        rc.apply_policy([], "sometimes")


def test_cli_prints_the_contract_keys(capsys):
    rc.main(["--policy", "selective", "--layers", "2", "--json"])   # in process: no second torch import
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["activation_bytes"] == r["formula_bytes"] and r["flops"] > 0
    assert r["flops_ratio_vs_none"] == pytest.approx(r["formula_flops_ratio_vs_none"], abs=1e-12)
    with pytest.raises(ValueError, match="k=3 must divide the 4 layers"):   # before anything runs
        rc.main(["--policy", "every-k", "--k", "3"])


def test_accumulation_of_unequal_micro_batches_equals_the_full_batch():
    r = rc.accumulation_vs_full_batch(accumulation=3)
    assert len(set(r["counts"][0])) > 1                     # unequal token counts per micro-batch
    assert r["right_err"] < loss_reduction.BOUND           # rounding only (see loss_reduction.BOUND)
    assert r["naive_err"] > loss_reduction.MARGIN          # the per-micro-batch mean is another objective


def test_no_sync_divides_the_all_reduces_but_not_the_bytes_per_step():
    k = 3
    r = rc.no_sync_counts(world_size=3, accumulation=k, steps=1)    # the notebook runs 2 ranks
    param_bytes = sum(p.numel() * p.element_size() for p in tiny.build().parameters())
    one, quiet, loud = r["no_accumulation"], r["no_sync"], r["sync_every_micro_batch"]
    assert quiet["calls_per_step"] == one["calls_per_step"] and loud["calls_per_step"] == k * one["calls_per_step"]
    assert quiet["payload_bytes_per_step"] == one["payload_bytes_per_step"] == param_bytes
    assert loud["payload_bytes_per_step"] == k * param_bytes
    for v in r.values():   # fp32 sums in another order: a few ulps (chapter 2's TOL)
        assert v["max_param_diff_vs_single_process"] < 1e-6


def test_exercises_answers_are_accepted():
    for q, answer in rc.EXERCISES.items():
        assert rc.check(q, answer())
    assert not rc.check("1", 2 * rc.EXERCISES["1"]())
