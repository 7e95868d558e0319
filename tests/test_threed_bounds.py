"""Chapter 17's drift bound, term by term, checked from below: a bound too tight passes every bug test
(a bug only leaves it sooner), so each term is set against a case where it is attained or computed by
hand."""
import pytest
import torch
import torch.nn.functional as F

from labs.threed import drift, rounding

U = 2.0 ** -24


@pytest.mark.numerics
@pytest.mark.parametrize("at", [1, 2])
def test_adam_drift_is_attained_where_the_moment_terms_add(at):
    """Three steps of Adam (float64), one step's gradient perturbed by +-d: the perturbed gradient is +a,
    the others -c a, so m's sign is against it and raising |g| lowers |m| while raising v. Both moment
    terms then move the step the same way and the first-order bound is attained (to d/a = 1e-6).
    Catches the second-moment term D dropped, the first-moment M halved, the bias correction left out
    (each leaves the bound below what Adam does), and a bound loose by 10 %."""
    a = 10 ** torch.linspace(-5, -2, 40, dtype=torch.float64)
    c = torch.tensor([2.0, 3.0, 5.0], dtype=torch.float64)
    a, c = (t.reshape(-1) for t in torch.meshgrid(a, c, indexing="ij"))
    grads = [a if s == at else -c * a for s in range(3)]
    deltas = [1e-6 * a if s == at else torch.zeros_like(a) for s in range(3)]
    runs = []
    for sign in (0, 1, -1):
        w = torch.full_like(a, 0.02).requires_grad_()
        opt = torch.optim.Adam([w], lr=1e-2)
        for s in range(3):
            w.grad = grads[s] + sign * deltas[s]
            opt.step()
        runs.append(w.detach())
    moved = torch.maximum((runs[1] - runs[0]).abs(), (runs[2] - runs[0]).abs())
    dw = drift.weight_drift([{"w": g} for g in grads], [{"w": d} for d in deltas], 1e-2)[-1][0]["w"]
    ratio = moved / dw
    assert ratio.max() <= 1 + 1e-4 and ratio.min() >= 0.999


def test_adam_drift_carries_the_weight_decay_feedback():
    """With coupled weight decay the weights' difference feeds the next gradient (decay * dw), so the
    same gradients and deltas give a larger bound with decay than without. Catches the feedback left
    out (the two bounds then agree)."""
    g = torch.Generator().manual_seed(0)
    grads = [{"w": torch.randn(50, generator=g, dtype=torch.float64) * 1e-3} for _ in range(3)]
    deltas = [{"w": torch.full((50,), 1e-9, dtype=torch.float64)}] * 3
    plain = drift.weight_drift(grads, deltas, 1e-2)[-1][0]["w"]
    decayed = drift.weight_drift(grads, deltas, 1e-2, weight_decay=1.0)[-1][0]["w"]
    assert (decayed > plain * (1 + 1e-3)).all()


def _watched(fn):
    m = torch.nn.Module()
    m.head = torch.nn.Linear(2, 2)            # Rounding needs a head; unused here
    with rounding.Rounding(m) as r:
        fn().backward()
    return r.forward


def test_rounding_charges_attention_softmax_and_loss_their_hand_computed_terms():
    """The terms only the context-parallel layout's reordering uses, each by hand with L chosen so
    dL/dy is known: an attention matmul A B (inner length 3) under L = sum(C * y): 2 gamma_3 <|C|,
    |A| |B|>; a softmax over 5 keys under L = sum(C * p): 2 gamma_5 <|C|, p>; a mean cross entropy
    over 6 tokens of 7 classes: 2 gamma_6 l. Catches the factor 2 dropped, gamma of another length
    (the rows, the classes), C's sign kept."""
    torch.manual_seed(0)
    a, b = torch.randn(2, 4, 3, requires_grad=True), torch.randn(2, 3, 5, requires_grad=True)
    C = torch.randn(2, 4, 5)
    got = _watched(lambda: (C * (a @ b)).sum())
    want = 2 * rounding.gamma(3, U) * (C.abs() * (a.abs() @ b.abs())).sum().item()
    assert got["attention"] == pytest.approx(want, rel=1e-6)
    x = torch.randn(2, 4, 5, requires_grad=True)
    got = _watched(lambda: (C * x.softmax(-1)).sum())
    want = 2 * rounding.gamma(5, U) * (C.abs() * x.detach().softmax(-1)).sum().item()
    assert got["softmax"] == pytest.approx(want, rel=1e-6)
    logits, targets = torch.randn(6, 7, requires_grad=True), torch.arange(6)
    got = _watched(lambda: F.cross_entropy(logits, targets))
    want = 2 * rounding.gamma(6, U) * F.cross_entropy(logits.detach(), targets).item()
    assert got["loss"] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("degrees", [{"tp": 4}, {"cp": 4}, {"pp": 4}])
def test_bytes_at_degree_four_equal_the_prediction(degrees):
    """The chapter's layouts have groups of 2 ranks, where a ring's 2(n-1)/n, a direct exchange's n-1
    and a plain M all give the same bytes; at 4 ranks (one step, 4 processes) they differ, so a
    prediction with the wrong factor of the degree fails here, as does a middle pipeline stage's
    second neighbour left out (pp = 4 has two middle stages)."""
    from labs.dims import ParallelDims
    from labs.threed import layout3d, train3d
    cfg, dims = layout3d.config(), ParallelDims(**degrees)
    [run] = train3d.run(dims, steps=1, timeout=120)
    for coords, steps in zip(run["coords"], run["sent"]):
        sent = dict(steps[0])
        assert sent.pop("other") == 0
        predicted = layout3d.predict_bytes_per_group(cfg, dims, layout3d.MICRO_BATCH,
                                                     layout3d.MICROBATCHES, cfg.seq_len, stage=coords["pp"])
        assert sent == predicted


@pytest.mark.parametrize("degrees", [{"dp": 2}, {"dp": 2, "cp": 2}])
def test_the_gradient_term_counts_the_tokens_the_step_really_sums(degrees, monkeypatch):
    """delta = 2 gamma_N |g|_abs with N the tokens whose terms each gradient adds: counted here from the
    batches one process's run is fed in a step, not from the formula. Catches N taken per replica, per
    micro-batch or halved (a bound too tight passes every bug test)."""
    from labs.dims import ParallelDims
    from labs.threed import layout3d
    seen = []
    real = layout3d.step_batches

    def counting(*args, **kwargs):
        for x, y in real(*args, **kwargs):
            seen.append(y.numel())
            yield x, y
    monkeypatch.setattr(layout3d, "step_batches", counting)
    b = drift.bound(ParallelDims(**degrees), steps=1)
    assert b["delta_scale"] == 2 * rounding.gamma(sum(seen), U)


def test_the_adam_term_is_each_steps_gradient_magnitude_times_the_previous_steps_drift(monkeypatch):
    """B_t's second term, sum_i |g_(t,i)| dw_(t,i), with dw the weights' drift after step t - 1's update,
    computed by hand on a made-up run: gradients with both signs, a drift that changes each step. Catches
    the abs taken after the sum (0.5 at step 2, not 1.1), the drift of the same step instead of the one
    before, step 1 given an Adam term (its loss precedes every update), and, under weight decay, the
    two gradients swapped: Adam's moments fed g instead of g + lambda w, or the loss term weighted by
    |g + lambda w| instead of |g|."""
    from types import SimpleNamespace

    from labs.dims import ParallelDims
    from labs.threed import layout3d
    grads = [{"w": torch.tensor([1.0, -2.0])}, {"w": torch.tensor([3.0, -4.0])},
             {"w": torch.tensor([-0.5, 1.0])}]
    # what Adam sees under coupled weight decay, g + lambda w: another tensor, so the two inputs differ
    adam_grads = [{"w": g["w"] + 10.0} for g in grads]
    watched = [SimpleNamespace(forward={"block": 0.0}, absgrad={"w": torch.zeros(2)}, row_parallel=0.0)
               for _ in grads]
    ref = {"losses": [1.0, 1.0, 1.0], "watched": watched, "grads": grads, "adam_grads": adam_grads}
    monkeypatch.setattr(layout3d, "reference", lambda *a, **k: ref)
    dws = [torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.5]), torch.tensor([0.0, 0.0])]
    seen = []

    def fake_drift(moments_of, *a, **k):
        seen.append(moments_of)
        return [({"w": dw}, {"w": torch.zeros(2, dtype=torch.bool)}) for dw in dws]
    monkeypatch.setattr(drift, "weight_drift", fake_drift)
    adam = drift.bound(ParallelDims(dp=2), steps=3, weight_decay=0.1)["adam"]
    # Adam's moments follow what Adam sees (g + lambda w); the loss term weights by the loss's own g:
    # step 2: |3| 0.1 + |-4| 0.2 = 1.1; step 3: |-0.5| 0.3 + |1| 0.5 = 0.65 (with g + lambda w: 3.0, 5.7)
    assert len(seen) == 1 and seen[0] is adam_grads
    assert adam == pytest.approx([0.0, 1.1, 0.65])
