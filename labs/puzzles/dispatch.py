"""Chapter 16, puzzle 8 (chapter 7 teaches it): MoE dispatch and combine with two all-to-alls.

The reader writes ``expert_parallel(moe, group)``: from the whole layer (`labs.expert_parallel.moe.MoE`:
router, N experts, top-k, no capacity limit, no residual) make this rank's expert-parallel forward
and return it (a module or a function of x). Rank r of ep keeps experts r N/ep .. (r+1) N/ep - 1. For
its T tokens it routes (``moe.decide(x)``: ``idx`` and ``gates``, (T, k)), sends each (token,
expert) pair's row of x to the expert's rank (dispatch), runs its experts on the rows that arrived,
sends each output row back (combine) and adds gate times row into the token's output. The moves are
``comm.all_to_all`` (torch's ``all_to_all_single`` with split sizes, counted), the split sizes
themselves exchanged first. The reference is chapter 7's `labs.expert_parallel.moe.ExpertParallelMoE`.

The routing is skewed on purpose (expert 0's balancing bias raised): expert 0 gets every token's
first choice, twice an even share T k / N (16 of 32 rows, an even share 8). Checked on every rank,
forward only:
- the output against one process running the whole layer in float64, within the float32 dot-product
  bound through both expert layers (Higham 2002, section 3.1): 2 (h + f + 4) u times the sum over the
  token's experts of g (( |x| |W1| + |b1| ) |W2| + |b2|). The factor, to first order: the first
  layer's dot product of length h plus its bias is off by (h + 1) u times its |.| sum, GELU's slope
  (at most 1.13) carries that on, its own rounding adds u |GELU(z)| <= u |z|, the second layer's
  length f plus its bias adds (f + 1) u, the gate's product and the top-k sum u each: at most
  (1.13 (h + 1) + f + 4) u times the scale, which 2 (h + f + 4) u covers with room for the
  second-order terms. A NaN is named as a NaN (`grader.nan_in`). Where a token differs, the
  grader finds which expert's term is missing or wrong (a mistake is recognised within the bound
  plus 1e-6, far below the gaps);
- the bytes: dispatch sends the rows this rank routes to other ranks' experts, combine returns the
  rows its experts got from other ranks, h fp32 values each (formula bytes of the library call,
  which sends exactly those rows), plus the split sizes (at most N int64 per rank).
"""
import copy

import torch

from labs.expert_parallel.moe import MoE, ExpertParallelMoE
from labs.measure import comm
from labs.puzzles import grader

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 8, 16, 4, 2, 8
U = 2.0**-24
HINT_HANG = ("every rank takes part in every all-to-all, in the same order: the split sizes, then "
             "dispatch, then combine; a rank with no rows for a peer still sends it a split of 0.")
reference = ExpertParallelMoE


def full_layer():
    layer = MoE(HIDDEN, EXPERTS, TOP_K, capacity_factor=None, ffn=FFN, seed=0, residual=False)
    layer.bias[0] = 1.0  # every token's first choice: an over-full expert
    return layer


def tokens(rank):
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(50 + rank))


def check(rank, world_size, fn):
    """On one rank: the reader's layer on this rank's tokens, its all-to-alls counted."""
    x = tokens(rank)
    with torch.no_grad(), comm.counting() as tally:
        layer = fn(copy.deepcopy(full_layer()), None)
        out = layer(x)
    return {"out": out, "bytes_sent": tally.formula_bytes_sent + tally.bytes_sent,
            "calls": tally.calls("all_to_all")}


def one_process(rank):
    """Each (token, choice) term g E_e(x) in float64, and its float32 rounding bound."""
    layer = full_layer().double()
    x = tokens(rank).double()
    with torch.no_grad():
        r = layer.decide(x)
        terms = torch.zeros(TOKENS, TOP_K, HIDDEN, dtype=torch.float64)
        scale = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
        for t in range(TOKENS):
            for j in range(TOP_K):
                ex, g = layer.experts[int(r.idx[t, j])], r.gates[t, j]
                terms[t, j] = g * ex(x[t])
                a, b = ex[0], ex[2]
                scale[t] += g * ((x[t].abs() @ a.weight.abs().T + a.bias.abs()) @ b.weight.abs().T
                                 + b.bias.abs())
    return r.idx, r.gates, terms, 2 * (HIDDEN + FFN + 4) * U * scale


def grade(fn, world_size=2, deadline=15.0):
    results = grader.run(check, fn, world_size, deadline, HINT_HANG)
    if isinstance(results, grader.Grade):
        return results
    per = EXPERTS // world_size
    routes = [one_process(r) for r in range(world_size)]
    load = torch.bincount(torch.cat([idx.reshape(-1) for idx, *_ in routes]), minlength=EXPERTS)
    for r, (res, (idx, gates, terms, bound)) in enumerate(zip(results, routes)):
        wrong_type = grader.not_tensor(r, res["out"], (TOKENS, HIDDEN), "your layer")
        if wrong_type:
            return wrong_type
        nan = grader.nan_in(r, "output", res["out"], "token", rows=True,
                            where=lambda t: f" (experts {idx[t].tolist()})")
        if nan:
            return nan
        err = (res["out"].double() - terms.sum(1)).abs()
        bad = grader.exceeds(err, bound).any(1).nonzero().reshape(-1)
        if len(bad):
            t = int(bad[0])
            got = res["out"][t].double()
            return grader.Grade(False, [f"rank {r}'s token {t} differs from one process: "
                                        + _which(got, terms[t], idx[t], gates[t], bound[t])],
                                _hint(got, terms[t], idx[t], load, world_size, r))
    row = HIDDEN * 4
    for r, res in enumerate(results):
        away = int((routes[r][0].reshape(-1) // per != r).sum())
        came = sum(int((idx.reshape(-1) // per == r).sum()) for s, (idx, *_) in enumerate(routes) if s != r)
        want = (away + came) * row
        sizes = res["bytes_sent"] - want
        if not 0 <= sizes <= 8 * EXPERTS:
            return grader.Grade(False, [
                f"rank {r} sent {res['bytes_sent']:,} bytes in {res['calls']} all-to-all(s); dispatch sends "
                f"the {away} rows it routes to other ranks' experts and combine returns the {came} rows its "
                f"experts got from other ranks: ({away} + {came}) x {row} = {want:,} bytes; "
                + (f"{sizes:,} bytes more than the routed rows (the split sizes take at most {8 * EXPERTS})"
                   if sizes > 0 else f"{-sizes:,} bytes too few")],
                "send each (token, expert) row only to the rank that holds the expert, and only the rows "
                "routed there; sending every token to every rank moves ep - 1 copies of each."
                if sizes > 0 else "move the rows with comm.all_to_all, so the grader can count them.")
    return grader.Grade(True, [
        f"expert-parallel MoE: {EXPERTS} experts on {world_size} ranks, {TOKENS} tokens per rank, "
        f"top-{TOP_K}; expert 0 got {int(load[0])} of {int(load.sum())} rows (an even share is "
        f"{int(load.sum()) // EXPERTS})",
        "every token's output: one process's within the float32 dot-product bound",
        "bytes: each routed row that leaves its rank sent once in dispatch and once back in "
        f"combine, {row} bytes each, plus the split sizes"])


def _which(got, terms, idx, gates, bound):
    """Name the expert whose term is missing, doubled or not gated, if one explains the output."""
    total = terms.sum(0)
    for j in range(TOP_K):
        e, g = int(idx[j]), gates[j].item()
        for label, guess in (("lacks", total - terms[j]), ("has twice", total + terms[j]),
                             ("has ungated", total - terms[j] + terms[j] / g)):
            if ((got - guess).abs() <= bound + 1e-6).all():
                return f"it {label} expert {e}'s output (gate {g:.3f})"
    i = int((got - total).abs().argmax())
    return (f"element {i} is {got[i].item():.4g}, one process says {total[i].item():.4g} "
            f"(experts {idx.tolist()})")


def _hint(got, terms, idx, load, n, rank):
    total, per = terms.sum(0), EXPERTS // n
    for j in range(TOP_K):
        e = int(idx[j])
        if torch.allclose(got, total - terms[j], atol=1e-5) and load[e] * EXPERTS > load.sum():
            return (f"expert {e} received {int(load[e])} rows, more than an even share "
                    f"({int(load.sum()) // EXPERTS}): "
                    "combine must send every output row back, with the dispatch's split sizes swapped; a "
                    "buffer sized for an even share drops the rest.")
        if torch.allclose(got, total - terms[j], atol=1e-5) and e // per != rank:
            return (f"expert {e} lives on rank {e // per}: dispatch the token's row there with "
                    "comm.all_to_all, and combine its output back the same way.")
    return ("sort each rank's (token, expert) pairs by expert before dispatch: the split sizes describe "
            f"consecutive blocks, rank r's experts r*{per}..; combine returns the rows in that sorted "
            "order, so add each, times its gate, into its token by the sorted token indices.")
