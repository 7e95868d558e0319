"""Chapter 7, one process: routing and capacity, the balancing losses (Switch's, DeepSeek-V3's bias and
sequence-wise loss), the router z-loss, dropless MoE beside capacity buffers. The exercises' checker is
tested in tests/test_exercise_answers_ch7.py."""
import pytest
import torch

from labs.expert_parallel import a2a_tail, dropless, moe, moe_routing as mr, router

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics

# fp32, different orders of the same additions (a grouped GEMM or a batched product against
# per-expert nn.Linear calls, and index_add orders): a few ulps of values of order 1. A row given
# to the wrong expert or a dropped pair kept errs by order 1.
TOL = 1e-5


def test_capacity_priority_first_choices_first():
    # 3 tokens, all prefer expert 0 then expert 1; capacity 2: token 2 loses expert 0, and the
    # first choices of tokens 0 and 1 do not lose to anyone's second choice
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]] * 3)
    r = router.route(logits, 2, cap=2)
    assert r.idx.tolist() == [[0, 1]] * 3
    assert r.keep.tolist() == [[True, True], [True, True], [False, False]]
    assert router.capacity(tokens=3, experts=4, top_k=2, capacity_factor=1.25) == 2  # ceil(1.875)


def token_major_keep(idx, cap, experts):
    """The plausible bug: each expert's queue filled token by token, a token's first and second
    choice together (token-major), instead of every first choice before any second choice."""
    onehot = torch.nn.functional.one_hot(idx.reshape(-1), experts)    # (T*k, N), token-major
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1
    return (position < cap).view(idx.shape)


def test_capacity_priority_is_choice_major_not_token_major():
    # Token 0 picks [0, 1]; tokens 1 and 2 pick [1, 2]. Capacity 2. Choice-major (the lab, GShard's
    # Algorithm 1): expert 1's queue is the first choices of tokens 1 and 2, then token 0's second
    # choice, which overflows; expert 0 holds one pair and expert 2 two, so all else is kept:
    # keep [[T, F], [T, T], [T, T]]. Token-major (the bug): expert 1's queue is token 0's second
    # choice, then token 1's first, then token 2's first, which overflows: token 2 loses its first
    # expert while token 0 keeps its second, [[T, T], [T, T], [F, T]].
    # (When every token picks the same two experts, as above, both orders keep the same pairs.)
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 3.0, 2.0, 0.0], [0.0, 3.0, 2.0, 0.0]])
    r = router.route(logits, 2, cap=2)
    assert r.idx.tolist() == [[0, 1], [1, 2], [1, 2]]
    assert r.keep.tolist() == [[True, False], [True, True], [True, True]]
    bug = token_major_keep(r.idx, 2, 4)
    assert bug.tolist() == [[True, True], [True, True], [False, True]]
    assert bug.tolist() != r.keep.tolist()                      # this case tells the two apart
    same = router.route(torch.tensor([[3.0, 2.0, 0.0, 0.0]] * 3), 2, cap=2)
    assert token_major_keep(same.idx, 2, 4).tolist() == same.keep.tolist()   # the old case does not


def test_switch_aux_loss_is_alpha_when_uniform_and_alpha_n_when_collapsed():
    n, k, alpha = 8, 2, 1e-2
    idx = torch.arange(32).view(16, 2) % n  # every expert chosen 4 times
    uniform = router.Routing(torch.full((16, n), 1 / n), idx, None, None)
    assert mr.switch_aux_loss(uniform, n, k, alpha).item() == pytest.approx(alpha, rel=1e-6)
    collapsed = router.Routing(torch.tensor([[1.0, 0, 0, 0]] * 4), torch.zeros(4, 1, dtype=torch.long), None,
                               None)
    assert mr.switch_aux_loss(collapsed, 4, 1, alpha).item() == pytest.approx(alpha * 4, rel=1e-6)


def test_sequence_wise_loss_sees_what_the_batch_wise_loss_averages_away():
    # two sequences of 4 tokens, top-1 of 2 experts: each sequence sends every token to one expert,
    # the batch as a whole is balanced
    probs = torch.tensor([[0.9, 0.1]] * 4 + [[0.1, 0.9]] * 4)
    r = router.Routing(probs, probs.argmax(1, keepdim=True), None, None)
    alpha = 1e-4
    batch = mr.switch_aux_loss(r, 2, 1, alpha).item()
    seq = mr.sequence_balance_loss(r, 2, 1, seq_len=4, alpha=alpha).item()
    assert batch == pytest.approx(alpha, rel=1e-5)                 # balanced: the uniform value
    assert seq == pytest.approx(alpha * 2 * 0.9, rel=1e-5)         # each sequence: N f_1 P_1 = 2 * 0.9
    # one sequence spanning the batch: V3's loss is Switch's (f^V3 = N f^Switch)
    assert mr.sequence_balance_loss(r, 2, 1, seq_len=8, alpha=alpha).item() == pytest.approx(batch, rel=1e-6)
    with pytest.raises(ValueError, match="do not split into sequences of 3"):
        mr.sequence_balance_loss(r, 2, 1, seq_len=3)


def test_router_z_loss_formula_and_its_effect_on_the_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    want = (torch.log(torch.tensor(4.0)) ** 2 + torch.log(torch.exp(torch.tensor(2.0)) + 3) ** 2) / 2
    assert router.router_z_loss(logits).item() == pytest.approx(want.item(), rel=1e-6)
    runs = mr.zloss_runs((0.0, 1e-2), steps=80)    # the notebook runs c_z = 1e-3 too
    assert runs[0.0]["z_loss"] > runs[0.0]["first_z_loss"]         # without it, L_z grows
    assert runs[1e-2]["z_loss"] < 0.75 * runs[0.0]["z_loss"]       # with it, L_z falls
    # logsumexp bounds the largest logit (max <= lse <= max + log N), not the smallest: with the
    # term the largest logit falls by more than 1, and the largest |logit| is a negative one
    assert runs[1e-2]["top_logit"] < runs[0.0]["top_logit"] - 1
    assert -runs[1e-2]["bottom_logit"] > runs[1e-2]["top_logit"] + 1


def test_dropless_and_capacity_buffers_equal_their_references_and_flops_follow_the_slots():
    r = dropless.compare(capacity_factors=(1.0, 2.0))
    assert r["routing_margin"] > router.margin_bound(8)
    assert r["ran"] == "torch._grouped_mm"                    # torch 2.13 runs it on the CPU
    for row in r["rows"]:
        assert row["error"] < TOL, row
    dl, cf1, cf2 = r["rows"]
    # FlopCounterMode sees the router, not _grouped_mm
    router_flops = r["dropless_flops_counter_sees"]
    assert dl["dropped"] == 0 and dl["slots"] == r["pairs"] and cf1["dropped"] > cf2["dropped"] > 0
    # counted FLOPs of the experts scale with the slots computed, padding included
    assert (cf2["flops"] - router_flops) * dl["slots"] == (dl["flops"] - router_flops) * cf2["slots"]


def test_grouped_gemm_falls_back_to_one_block_diagonal_product(monkeypatch):
    x, w = torch.randn(7, 4), torch.randn(3, 4, 5)
    counts = torch.tensor([2, 0, 5])
    want = torch.cat([x[:2] @ w[0], x[2:] @ w[2]])
    monkeypatch.delattr(torch, "_grouped_mm")
    got = dropless.grouped_mm(x, w, counts)
    assert dropless.grouped_mm.last == "block-diagonal matmul"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)   # zeros added: the same products


def inclusion_z(probs, pi, draws=100_000, seed=0):
    """Each expert's Monte-Carlo inclusion frequency, over ``draws`` tokens routed top-2 by
    `router.route` from `mr.skewed_logits` (k draws without replacement from ``probs``), against
    ``pi``: the largest deviation in standard deviations (a token includes expert i or not, so the
    count is Binomial(draws, pi_i); its s.d. is estimated as sqrt(f (1 - f) / draws) from the
    frequency f, since a wrong ``pi`` may exceed 1)."""
    r = router.route(mr.skewed_logits(draws, probs, torch.Generator().manual_seed(seed)), 2)
    est = torch.bincount(r.idx.reshape(-1), minlength=len(probs)).double() / draws
    return ((est - pi).abs() / (est * (1 - est) / draws).sqrt()).max().item()


def test_inclusion_probability_matches_top_k_draws_and_refuses_k_times_p():
    # The tail test (tests/test_moe.py) bounds each rank's bytes at 4 s.d. of 2 small batches, so
    # a plausible bug, pi = k p (k draws with replacement, or the top-1 formula scaled), passes it
    # at zeta = 1. Here 100,000 draws: one s.d. is at most 0.5 / sqrt(1e5) = 0.0016, and the
    # test allows 5 s.d. per expert (a chance failure over 8 experts: about 8 * 6e-7). The bug's
    # gap is largest at expert 1: 2 p_1 - pi_1 = 0.105 at zeta = 1 (p_1 = 0.368, pi_1 = 0.631,
    # s.d. 0.0015: about 70 s.d., 14 times the allowance) and 0.237 at zeta = 1.5 (about 190 s.d.).
    for zeta in (1.0, 1.5):
        p = mr.zipf_probs(8, zeta)
        pi = a2a_tail.inclusion(p, 2)
        assert abs(pi.sum().item() - 2) < 1e-12                    # k experts per token
        assert inclusion_z(p, pi) < 5
        assert inclusion_z(p, 2 * p) > 10 * 5                      # the k p bug, refused by far
    assert torch.equal(a2a_tail.inclusion(p, 1), p)                # k = 1: pi = p


def test_dropped_fraction_follows_the_load_distribution():
    rows = mr.drop_curve([0.5, 1.0, 1.5, 2.0], trials=30)
    for row in rows:
        # batch by batch, the layer drops exactly sum_i max(0, L_i - C) / T of its measured loads
        assert row["per_batch"] == pytest.approx(row["from_loads"], abs=1e-9)
        # and on average what the Binomial(T, p_i) loads predict: within 4 standard errors
        assert abs(row["measured"] - row["predicted"]) < 4 * row["stderr"]
        assert row["routing_margin"] > router.margin_bound(8)   # the same choices on every CPU
    assert [r["measured"] for r in rows] == sorted((r["measured"] for r in rows), reverse=True)


def test_balancing_orders_the_final_imbalance():
    runs = mr.balance_runs(steps=150)  # the notebook runs 250; the order is set by step 150
    floor = runs["uniform_floor"]  # max/mean of a router with no preference, about 1.2 at T = 128
    # no balancing collapses toward N/k = 4; the bias and the aux loss at alpha = 0.1 reach the
    # floor: within 0.15, several times the spread of a 20-step mean of a uniform router's
    # max/mean (one step's standard deviation / sqrt(20)), while the unbalanced runs stay more
    # than 1.2 above it; alpha = 1e-2 is too weak in this many steps
    assert 0.15 > 4 * runs["uniform_spread"] / 20 ** 0.5
    assert runs["none"]["final"] > 2.5 and runs["aux 0.01"]["final"] > 2.5
    assert runs["bias 0.001"]["final"] < floor + 0.15 and runs["aux 0.1"]["final"] < floor + 0.15


@pytest.mark.numerics
def test_the_layer_is_the_switch_equation_plus_the_residual():
    """Against sum_{i in top-k} softmax(x W_r)_i E_i(x), written here token by token from the
    layer's weights: a gate renormalised over the top k, a missing gate, the wrong expert, or a
    residual added twice or not at all would each miss by far more than the tolerance."""
    torch.manual_seed(1)
    x = torch.randn(8, 16)
    for residual in (False, True):
        layer = moe.MoE(residual=residual)
        probs = torch.softmax(x @ layer.router.weight.T, dim=-1)          # (T, N)
        want = torch.stack([sum(probs[t, i] * layer.experts[i](x[t:t + 1])[0]
                                for i in probs[t].topk(layer.top_k).indices.tolist())
                            for t in range(len(x))])                        # (T, h)
        # fp32, the same products summed in another order (k = 2 terms per token): a few ulps
        torch.testing.assert_close(layer(x), x + want if residual else want, rtol=1e-5, atol=1e-6)
