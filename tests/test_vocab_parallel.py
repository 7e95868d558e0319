"""Chapter 4, when TP stops paying: vocabulary-parallel loss, GQA under TP, the comm/compute condition.

One job per world size (2 and 3) runs all three labs; the tests share it.
"""
import functools

import pytest
import torch

from labs.memory_budget import budget
from labs.tensor_parallel import gqa_parallel as gqa, tp_limits as tl, vocab_parallel as vp
from labs.launcher import launch

# The tests marked `numerics` compare floating-point results: `make test` runs them under
# another CPU's rounding. The others compare bytes, counts, schedules or refusals.

B, S, H, V = 2, 8, 16, 96            # vocabulary lab: V divisible by 2 and 3
KV = {2: (1, 2), 3: (1, 3)}          # GQA lab, 12 query heads: replicate at kv = 1, split at kv = tp


def suite(rank, world_size):
    return {"vocab": vp.check(rank, world_size, B, S, H, V),
            "gqa": gqa.check_many(rank, world_size, KV[world_size]),
            "layer": tl.measure_layer(rank, world_size)}


@functools.lru_cache(maxsize=None)
def run(world_size):
    return launch.spawn(suite, world_size, timeout=120)


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_loss_and_gradients_equal_the_unsharded(world_size):
    for r in (x["vocab"] for x in run(world_size)):
        # fp32: the sharded loss sums exp over V/tp logits per rank, then over ranks; the unsharded
        # one over V at once: the same terms in another order, a few ulps of a loss of about 5.
        torch.testing.assert_close(r["loss"], r["loss_ref"], rtol=1e-6, atol=0)
        for name, (local, ref) in r["grads"].items():
            # gradients of order 1e-3 (softmax / (b s) times weights): 1e-5 relative is ~100 ulps.
            # A missing f all-reduce before the head, or an unmasked embedding, errs by 100 %.
            assert ref.abs().max() > 1e-4, name
            torch.testing.assert_close(local, ref, rtol=1e-5, atol=1e-8, msg=name)


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_all_reduces_and_logits_memory(world_size):
    for r in (x["vocab"] for x in run(world_size)):
        c = r["counts"]
        # read from the tensors handed to labs.measure.comm: the embedding's b*s*h sum; the loss's three
        # (b, s) fp32 reductions (max, target logit, sum of exps); f's b*s*h in backward. Gathering
        # the logits instead would show b*s*V/tp-sized payloads here.
        assert c["embedding"] == {"calls": 1, "payloads": [B * S * H * 4]}
        assert c["loss"] == {"calls": 3, "payloads": [B * S * 4] * 3}
        assert c["backward"] == {"calls": 1, "payloads": [B * S * H * 4]}
        per = V // world_size
        assert r["logits_shape"] == (B, S, per) and r["logits_dtype"] == "torch.float32"
        assert r["logits_bytes"] == {"per_rank": B * S * per * 4, "unsharded": B * S * V * 4}
        # what the loss keeps for backward, by storage: the fp32 softmax slice, the local target
        # index (int64) and the out-of-range mask (bool); the unsharded loss keeps the whole log-softmax
        assert r["loss_saved_bytes"]["per_rank"] == B * S * per * 4 + B * S * (8 + 1)
        assert r["loss_saved_bytes"]["unsharded"] >= B * S * V * 4
        assert r["params"]["per_rank"] * world_size == r["params"]["unsharded"]


def test_vocab_not_divisible_by_tp_is_refused():
    # refused, not padded: padded logits would enter the softmax and change the loss (see
    # labs.tensor_parallel.vocab_parallel)
    with pytest.raises(ValueError, match="V = 100 is not divisible by tp = 3"):
        vp.check(0, 3, vocab=100)
    big = vp.logits_bytes_at_scale(b=1, s=8192, vocab=128256, tp=8)
    assert big["unsharded"] == 8192 * 128256 * 4 and big["unsharded"] == 8 * big["per_rank"]


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3])
def test_gqa_under_tp_equals_the_unsharded_layer(world_size):
    d, h = 48 // 12, 48
    for rank_result in run(world_size):
        for kv, r in rank_result["gqa"].items():
            mode = "split" if kv % world_size == 0 else "replicate"
            assert r["layout"]["mode"] == mode
            # fp32 gradients of order 10 (ulp 9.5e-7), each a sum over b*s = 16 tokens that the sharded
            # layer's smaller matmuls may block in another order (BLAS picks kernels by shape, and
            # differently on another CPU): 2e-5 is about 20 ulps. The bug it guards against, a KV
            # gradient left unsummed over its copies, errs by more than 1 (asserted below).
            assert max(r["errors"].values()) < 2e-5, (kv, r["errors"])
            p = r["allreduce_payloads"]
            assert p["forward"] == [2 * 8 * h * 4] and p["backward"] == [2 * 8 * h * 4]
            if mode == "replicate":
                # a copy's gradient is partial until summed over its tp/kv holders: d x h per K and V
                assert r["kv_grad_error_unsummed"] > 1 and p["kv_grad_sum"] == [d * h * 4] * 2
                assert r["kv_params"]["per_rank"] == r["kv_params"]["unsharded"] // kv
            else:
                # nothing to sum: the KV gradients are the ones compared above, so the same bound
                # (not 0: the unsharded layer's K and V projections are wider matmuls)
                assert r["kv_grad_error_unsummed"] == max(r["errors"]["wk"], r["errors"]["wv"]) < 2e-5
                assert p["kv_grad_sum"] == []
                assert r["kv_params"]["per_rank"] * world_size == r["kv_params"]["unsharded"]


def gqa_two_holders(rank, world_size):
    return gqa.check_many(rank, world_size, (2,))


@pytest.mark.numerics
def test_gqa_replicas_sum_over_their_own_holders_only():
    """tp = 4 with 2 KV heads: each head on two ranks, the layout of Llama 2 70B at tp = 16. With one
    KV head the copy group is the whole tp group, so summing the copies' gradients over all of tp
    would pass there; here it errs by more than 1, and only the per-head groups give the layer."""
    for r in (x[2] for x in launch.spawn(gqa_two_holders, 4, timeout=120)):
        assert r["layout"]["mode"] == "replicate" and r["layout"]["kv_heads_per_rank"] == 1
        assert max(r["errors"].values()) < 2e-5, r["errors"]   # same bound as above
        assert r["kv_grad_error_unsummed"] > 1


def test_gqa_layouts_and_the_divisibility_error():
    assert gqa.kv_layout(64, 8, 8)["mode"] == "split" and gqa.kv_layout(64, 8, 8)["kv_heads_per_rank"] == 1
    assert gqa.kv_layout(64, 8, 16) | {} == {"mode": "replicate", "q_heads_per_rank": 4,
                                             "kv_heads_per_rank": 1, "copies_per_kv_head": 2,
                                             "kv_fraction_per_rank": 1 / 8}
    with pytest.raises(ValueError,
                       match="^3 KV heads cannot be split or replicated over tp = 2: tp must divide"):
        gqa.kv_layout(12, 3, 2)
    with pytest.raises(ValueError, match="query heads = 64 is not divisible by tp = 3"):
        gqa.kv_layout(64, 8, 3)


@pytest.mark.parametrize("world_size", [2, 3])
def test_tiny_layer_flops_and_bytes_match_the_condition(world_size):
    results = [x["layer"] for x in run(world_size)]
    assert all(r["payloads"] == results[0]["payloads"] for r in results)
    for r in results[:1]:  # FLOPs are counted on rank 0 (see tp_limits.measure_layer)
        # FlopCounterMode: 2 * 12h^2 / tp per token plus q k^T and scores x v, 4 b s^2 h / tp;
        # forgetting the 1/tp on either term, or counting the MLP at 8h^2, would break equality
        assert r["flops"] == r["flops_formula"]
        assert r["payloads"] == [2 * 8 * 48 * 4] * 2     # two all-reduces of b*s*h fp32: h, not 4h


def test_comm_compute_condition_at_scale():
    c = tl.condition("70B")
    nv, ib = c["links"][tl.NVLINK], c["links"][tl.INFINIBAND]
    for link in (nv, ib):
        for row in link["rows"]:   # the closed form in h agrees with layer_costs' two times
            assert row["ratio"] == pytest.approx(tl.ratio(8192, row["tp"], link["bandwidth"], 989e12, 4096,
                                                          c["layer_params"]), rel=1e-12)
        assert tl.ratio(8192, link["crossover_tp"], link["bandwidth"], 989e12, 4096, c["layer_params"]) == \
            pytest.approx(1)
    assert (nv["crossover_tp"] == pytest.approx(13.81, abs=0.01)
            and ib["crossover_tp"] == pytest.approx(2.42, abs=0.01))
    assert nv["first_comm_bound_tp"] == 16 and ib["first_comm_bound_tp"] == 4
    # across two 8-GPU nodes the ring leaves each node through its 8 NICs (the node's 400 GB/s egress,
    # Austin et al. 2025, Part 12), not through one NIC's 50 GB/s: tp* = 12.4, near NVLink's 13.8.
    # The model that put every rank of the ring on one NIC gave 2.4 here and fails this.
    two = c["links"][tl.TWO_NODES]
    assert two["bandwidth"] == 8 * 50e9 == budget.LINKS[tl.TWO_NODES]
    assert two["crossover_tp"] == pytest.approx(12.39, abs=0.01) and two["first_comm_bound_tp"] == 16
    assert two["crossover_tp_step"] > 16 > two["crossover_tp"]        # tp = 16: past fwd, under the step
    # b cancels: the messages grow with the micro-batch as fast as the FLOPs do
    big = tl.condition("70B", micro_batch=4)["links"][tl.NVLINK]["rows"]
    assert [r["ratio"] for r in big] == pytest.approx([r["ratio"] for r in nv["rows"]], rel=1e-12)
    # a wider h moves the crossover out, about as 1 + 3 h W / C
    cross = [row[tl.NVLINK] for row in tl.crossover_table()]
    assert cross == sorted(cross)
    with pytest.raises(ValueError, match="need tp >= 1"):
        tl.ratio(8192, 0, 450e9, 989e12)


def test_layout_ratios_use_the_ring_bandwidth_of_each_placement():
    lay = tl.layout_ratios("70B")
    two = {r["tp"]: r for r in lay["two nodes, tp/2 GPUs each"]}
    # two nodes with 4 GPUs each (tp = 8) use 4 NICs: 200 GB/s, past comm = compute (condition's fixed
    # 400 GB/s would put it at 0.62, below)
    assert two[8]["bandwidth"] == 200e9 and two[8]["ratio"] == pytest.approx(1.23, abs=0.01)
    assert two[16]["ratio"] == pytest.approx(1.32, abs=0.01) and two[2]["bandwidth"] == 50e9
    assert [r["tp"] for r in lay["one node, NVLink"]] == [2, 4, 8]          # a node holds 8 GPUs
    assert all(r["bandwidth"] == 50e9 for r in lay["one GPU per node"])
    assert all(r["bandwidth"] == 400e9 for r in lay["tp/8 full nodes"])


def test_ring_bandwidth_across_nodes_is_the_nodes_egress():
    assert tl.ring_bandwidth(1, 8) == 450e9                         # one node: NVLink
    assert tl.ring_bandwidth(2, 8) == 400e9                         # two full nodes: 8 NICs x 50 GB/s
    assert tl.ring_bandwidth(8, 1) == 50e9                          # a node per rank: one NIC each
    assert tl.ring_bandwidth(4, 2) == 100e9
    with pytest.raises(ValueError, match="GPUs of the group per node"):
        tl.ring_bandwidth(2, 9)


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_loss_shift_at_large_logits_refuses_the_named_mistakes(world_size):
    # Logits near 1e3, where fp32 exp overflows (past 88.7): only the global MAX subtracted gives
    # the unsharded loss. At O(1) logits both mistakes passed the checks above (same calls, same
    # payloads, loss gaps < 1e-7); here a SUM of the ranks' maxima underflows every exp (-inf) and
    # no shift overflows them (inf), so neither gives a finite loss.
    for r in (x["vocab"]["large_logits"] for x in run(world_size)):
        loss_gap, grad_gap = vp.gaps(r["max"])
        assert loss_gap < 1e-6 and grad_gap < 1e-5, (loss_gap, grad_gap)
        for mistake in ("sum", "none"):
            assert not torch.isfinite(r[mistake]["loss"]), mistake
            loss_gap, grad_gap = vp.gaps(r[mistake])
            assert not loss_gap < 1e-6, mistake
