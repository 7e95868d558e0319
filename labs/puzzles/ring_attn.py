"""Chapter 16, puzzle 7 (chapter 6 teaches it): ring attention's K/V rotation with the online softmax and
the causal mask.

The reader writes ``ring_attention(q, k, v)``: rank r of N holds block r of a causal sequence, t
consecutive tokens (positions r t .. r t + t - 1), as (t, d) queries, keys and values, and returns
its queries' attention output (t, d), softmax(q K^T / sqrt(d) + mask) V over the keys at or before each
query. At step s it holds the K/V block of rank (r - s) mod N and passes it right while receiving
the next from the left (``comm.isend``/``comm.irecv``, counted); a block from a later rank is
skipped, its own block gets the triangular mask, and each block's partial output o with its
log-sum-exp l is merged into the running (out, L) by the online softmax:
L' = log(e^L + e^l), out' = e^(L - L') out + e^(l - L') o. The reference is chapter 6's
`labs.context_parallel.ring_attention.ring_attention` (`reference` gives it this puzzle's shapes).

Checked on every rank, forward only, against one process's causal attention in float64:
- each output row within a float32 bound: a score's dot product of length d is off by at most
  d u S (S: the largest sum_l |q_l k_l| / sqrt(d)), which moves a softmax weight by a factor of at
  most e^(2 d u S), so the row by 2 d u S max|v|; the exponentials, a sum of up to T terms and N
  merges add (T + 3N + 4) u max|v|. A NaN is named as a NaN (`grader.nan_in`); a row NaN in every
  column is what a softmax over keys all masked gives (0/0), and only then is that cause named. Where
  a row differs the grader names the likeliest cause: the mask shifted by a block, later ranks'
  blocks attended to, blocks summed without renormalising, K/V never rotated, or K/V received but
  the rank's own block used; a mistake is recognised within the bound plus 1e-6, an absolute slack
  far below the gaps between these variants;
- the bytes: N - 1 hops of this rank's-size K and V blocks, 2 (N-1) 4 t d per rank
  (`ring_attention.ring_bytes`);
- the ring: every block rank r sends goes to rank r + 1 and every one it receives comes from rank
  r - 1 (the peers `comm` logs). Sending K and V straight to every rank sends the same bytes and
  gives the same output, but holds all N blocks at once, which the ring exists to avoid.
"""
import math

import torch

from labs.context_parallel import ring_attention as chapter6
from labs.measure import comm
from labs.puzzles import grader

T_BLOCK, D = 4, 8
U = 2.0**-24
HINT_HANG = ("a ring where every rank first waits to receive never starts: post the send of the block "
             "you hold and the receive of the next together (comm.isend and comm.irecv), then wait.")


def reference(q, k, v):
    """Chapter 6's ring attention on this puzzle's (t, d) blocks: contiguous split, causal."""
    n = torch.distributed.get_world_size()
    table = [[(r * q.shape[0], q.shape[0])] for r in range(n)]
    return chapter6.ring_attention(q[None, None], k[None, None], v[None, None], table)[0, 0]


def qkv(rank):
    g = torch.Generator().manual_seed(60 + rank)
    return [torch.randn(T_BLOCK, D, generator=g) for _ in range(3)]


def check(rank, world_size, fn):
    q, k, v = qkv(rank)
    with torch.no_grad(), comm.counting() as tally:
        out = fn(q.clone(), k.clone(), v.clone())
    return {"out": out, "bytes_sent": tally.bytes_sent, "sends": tally.calls("send"), "log": tally.messages}


def attention(q, k, v, visible):
    """Softmax attention of q over the keys where ``visible`` (a (Tq, Tk) bool mask) holds, float64."""
    s = (q @ k.T) / math.sqrt(q.shape[1])
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v


def variants(world_size, rank):
    """This rank's right output and the outputs of the classic mistakes, all in float64."""
    blocks = [[t.double() for t in qkv(r)] for r in range(world_size)]
    q = blocks[rank][0]
    k = torch.cat([b[1] for b in blocks])
    v = torch.cat([b[2] for b in blocks])
    t = T_BLOCK
    rows = torch.arange(rank * t, rank * t + t)[:, None]
    cols = torch.arange(world_size * t)[None, :]
    out = {"right": attention(q, k, v, cols <= rows)}
    out["sees one block ahead"] = attention(q, k, v, cols <= rows + t)
    if rank:
        out["misses its own block"] = attention(q, k, v, cols <= rows - t)
    diag = torch.arange(t)[:, None] >= torch.arange(t)[None, :]
    own = attention(q, blocks[rank][1], blocks[rank][2], diag)
    out["has only its own K/V block"] = own
    if rank + 1 < world_size:
        later = cols >= rank * t + t
        out["attends to keys of later ranks' blocks"] = attention(q, k, v, (cols <= rows) | later)
    if rank:  # the ring turned, but each step used the rank's own K and V instead of the block it held
        mine = [blocks[rank][i].repeat(rank + 1, 1) for i in (1, 2)]
        seen = torch.cat([diag] + [torch.ones(t, t, dtype=torch.bool)] * rank, 1)
        out["received K/V but used its own block at every step"] = attention(q, *mine, seen)
    out["sums the blocks' softmaxes without renormalising"] = own + sum(
        attention(q, blocks[b][1], blocks[b][2], torch.ones(t, t, dtype=torch.bool)) for b in range(rank))
    scale = (q.abs() @ k.abs().T).max() / math.sqrt(D)
    bound = (2 * D * U * scale + (world_size * t + 3 * world_size + 4) * U) * v.abs().max()
    return out, bound


HINTS = {
    "attends to keys of later ranks' blocks": (
        "a block from a later rank (owner > r) holds only future keys: skip it, do not attend to it."),
    "received K/V but used its own block at every step": (
        "after each wait, compute with the block that arrived (k, v = k_next, v_next), not with the "
        "rank's own k and v."),
    "sees one block ahead": ("the causal mask is off by one block: skip the blocks of later ranks "
                             "(owner > r), mask only your own block (owner == r), take earlier ones whole."),
    "misses its own block": "the causal mask is off by one block: your own block (owner == r) is attended "
                            "too, with the triangular mask key position <= query position.",
    "has only its own K/V block": "K and V never left their rank: at each step pass the block you hold to "
                                  "rank r + 1 and receive the next from rank r - 1, N - 1 times.",
    "sums the blocks' softmaxes without renormalising": (
        "each block's softmax is normalised over that block only: keep the log-sum-exp L and merge, "
        "out = e^(L - L') out + e^(l - L') o with L' = log(e^L + e^l)."),
}


def grade(fn, world_size=3, deadline=15.0):
    results = grader.run(check, fn, world_size, deadline, HINT_HANG)
    if isinstance(results, grader.Grade):
        return results
    t = T_BLOCK
    for r, res in enumerate(results):
        out, bound = variants(world_size, r)
        got = res["out"]
        wrong_type = grader.not_tensor(r, got, (t, D), "your ring_attention")
        if wrong_type:
            return wrong_type
        nan = grader.nan_in(r, "output", got, "row", rows=True,
                            where=lambda i: f" (query position {r * t + i})")
        if nan:
            i = int(got.isnan().any(1).nonzero()[0])
            if got[i].isnan().all():  # every column: the softmax of a row whose keys are all masked
                nan.lines[0] += (" in every column, as a softmax over keys that are all masked gives (0/0), "
                                 "and the merge keeps it (NaN x 0 is NaN)")
                nan.hint = ("skip a later rank's block (owner > r) instead of masking all of it with -inf; "
                            "your own block's triangular mask leaves every row at least one key.")
            return nan
        err = (got.double() - out["right"]).abs().amax(1)
        if grader.exceeds(err, bound).any():
            i = grader.worst(err, bound)
            # a mistake need only be recognised, not graded: its float32 rounding differs from the
            # float64 variant's by about the bound, and 1e-6 more is far below the gaps between variants
            cause = next((name for name, o in out.items() if name != "right"
                          and ((got.double() - o).abs().amax(1) <= bound + 1e-6).all()), None)
            line = (f"rank {r}'s output row {i} (query position {r * t + i}) differs from one process's "
                    f"causal attention by {err[i].item():.3g}")
            return grader.Grade(False, [line + (f": it {cause}" if cause else "")],
                                HINTS.get(cause, "check each step: which rank's block you hold, (r - s) "
                                          "mod N, which of its keys the mask lets each query see, and the "
                                          "merge."))
    want = chapter6.ring_bytes(4 * t * D, world_size)["forward"]
    for r, res in enumerate(results):
        if res["bytes_sent"] != want:
            more = res["bytes_sent"] - want
            return grader.Grade(False, [
                f"rank {r} sent {res['bytes_sent']:,} bytes in {res['sends']} messages; ring attention "
                f"passes K and V N - 1 times, 2 (N-1) 4 t d = {want:,}: {abs(more):,} bytes "
                f"{'too many' if more > 0 else 'too few'}"],
                "send the block you hold, K and V, once per step, N - 1 steps; the last block need "
                "not travel on.")
    for r, res in enumerate(results):
        for j, (kind, peer, nbytes) in enumerate(res["log"]):
            if peer != ((r + 1) % world_size if kind == "send" else (r - 1) % world_size):
                way = "went to" if kind == "send" else "came from"
                return grader.Grade(False, [
                    f"rank {r}'s message {j + 1} ({kind}, {nbytes} bytes) {way} rank {peer}: in the ring "
                    f"rank r sends K and V only to r + 1 = {(r + 1) % world_size} and receives only from "
                    f"r - 1 = {(r - 1) % world_size}"],
                    "the same bytes sent to every rank at once gather all N blocks on each rank; the ring "
                    "holds two at a time: the one in use and the next, arriving from the left.")
    return grader.Grade(True, [
        f"causal ring attention, {world_size} ranks of t = {t} tokens, d = {D}",
        "every row: one process's causal attention within the float32 bound, on every rank",
        f"bytes per rank: K and V passed N - 1 times, 2 (N-1) 4 t d = {want:,}, counted message by message, "
        "each to rank r + 1"])
