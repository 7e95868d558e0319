"""Chapter 6: context parallelism, the sequence split over cp ranks inside attention.

Three ways to compute exact attention when each of cp ranks holds T/cp tokens, each in its own
file, all checked here against one process's attention (outputs and dQ, dK, dV):
- ring attention (`labs.context_parallel.ring_attention`, Liu et al. 2023): K/V blocks passed around
  a ring, forward and backward by hand;
- DeepSpeed-Ulysses (`labs.context_parallel.ulysses`, Jacobs et al. 2023): all-to-all from a sequence
  split to a head split and back;
- all-gather CP (`labs.context_parallel.allgather_cp`, Llama Team 2024, §3.3.2): K and V
  all-gathered, dK and dV reduce-scattered.

How the tokens are split (``order``): "contiguous" gives rank i tokens [i T/cp, (i+1) T/cp);
"zigzag" cuts the sequence into 2cp chunks and gives rank i chunks i and 2cp-1-i (Llama Team 2024,
§3.3.2; Megatron-LM's get_batch_on_this_cp_rank; zhuzilin/ring-flash-attention issue #2). Striped
Attention (Brandon et al. 2023, arXiv 2311.09431) balances the same triangle by giving rank i the
tokens i, i + cp, i + 2cp, ...; the lab does not build it.

Work (`work_formula`): the kernel computes a tile below the causal diagonal whole and a tile on
it in blocks of beta tokens, skipping the hidden ones: c(c + beta)/2 of its c^2 entries, with
beta the chunk itself when ``block`` is None. Contiguously rank i computes i c^2 + c(c + beta)/2,
so max/mean = (2cp - 1 + beta/c)/(cp + beta/c): 2cp/(cp + 1) with whole tiles, (2cp - 1)/cp
as beta/c -> 0. Zig-zag gives every rank c^2 cp/2 + c beta/2, the contiguous split's mean.

Not used here: PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` does not run
on CPU (it shards the CUDA SDPA kernels; there is no CPU SDPA sharding), so this chapter builds
ring attention by hand and shows no library run on gloo.

    python -m labs.context_parallel.methods --world-size 4 --method ring --seq-len 32 --causal \\
        --order zigzag --json
"""
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from labs.context_parallel import allgather_cp, crossover, ring_attention as ra, ulysses
from labs.measure import comm
from labs.launcher import launch, preflight

METHODS = ("ring", "ulysses", "allgather")
ORDERS = ("contiguous", "zigzag")


def layout(cp, seq_len, order):
    """Every rank's chunks of the sequence, ``[[(start, length), ...] for each rank]``."""
    if order == "contiguous":
        c = seq_len // cp
        return [[(i * c, c)] for i in range(cp)]
    c = seq_len // (2 * cp)
    return [[(i * c, c), ((2 * cp - 1 - i) * c, c)] for i in range(cp)]


def check_config(cp, seq_len, order, method, heads, kv_heads, block=None):
    """Refuse a split that cannot be made, in one sentence, before any rank starts."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; use one of {', '.join(ORDERS)}.")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}.")
    pieces = cp if order == "contiguous" else 2 * cp
    if seq_len % pieces:
        raise ValueError(f"the {order} split cuts the sequence into {pieces} equal chunks: seq_len "
                         f"= {seq_len} is not divisible by {pieces}; choose a multiple of {pieces}.")
    if heads % kv_heads:
        raise ValueError(f"GQA needs the KV heads to divide the query heads: {kv_heads} does not "
                         f"divide {heads}.")
    if method == "ulysses":
        ulysses.check_heads(heads, kv_heads, cp)
    if block is not None and (block < 1 or (seq_len // pieces) % block):
        raise ValueError(f"the kernel's block of {block} tokens must divide the chunks of "
                         f"{seq_len // pieces} tokens; choose a divisor of {seq_len // pieces}.")


def rows_of(chunks):
    return torch.cat([torch.arange(s, s + n) for s, n in chunks])


def inputs(batch, heads, kv_heads, seq_len, head_dim, device):
    """Q (B, a, T, d), K and V (B, k, T, d) and an upstream gradient dO, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, generator=g) for _ in range(2))
    do = torch.randn(batch, heads, seq_len, head_dim, generator=g)
    return [t.to(device) for t in (q, k, v, do)]


def reference(q, k, v, causal):
    """One process's attention, the library kernel (GQA by enable_gqa): out and leaf copies with grads."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), (q, k, v)


def run_method(method, q, k, v, table, causal, work, hand=True, fused=True, block=None):
    if method == "ring":
        return ra.ring_attention(q, k, v, table, causal, work=work, block=block)
    if method == "ulysses":
        return ulysses.ulysses_attention(q, k, v, table, causal, work=work, hand=hand, fused=fused,
                                         block=block)
    return allgather_cp.allgather_attention(q, k, v, table, causal, work=work, block=block)


def bytes_formula(method, q_bytes, kv_bytes, cp, kv_heads):
    """What this rank's implementation sends, derived (counted messages), forward and backward."""
    if method == "ring":
        return ra.ring_bytes(kv_bytes, cp)
    if method == "ulysses":
        return ulysses.ulysses_bytes(q_bytes, kv_bytes, cp, kv_heads)
    return allgather_cp.allgather_bytes(kv_bytes, cp)


def check(rank, world_size, method="ring", seq_len=24, causal=True, order="zigzag", heads=4, kv_heads=2,
          head_dim=8, batch=2, hand=True, fused=True, block=None):
    """One method against one process's attention, on this rank's rows.

    Returns ``errors`` (max abs difference: output, dq, dk, dv), ``bytes_sent`` (counted messages,
    forward and backward; 0 for Ulysses with ``hand=False``, whose all_to_all_single is a library
    collective: see its ``calls`` and ``payloads``), ``messages`` (point-to-point messages sent),
    ``calls`` and ``payloads`` (per operation, from labs.measure.comm), ``bytes_formula`` (the
    derivation, from this rank's Q and K sizes), ``work`` (tiles computed whole and masked; score
    entries the kernel computes; unmasked entries) and ``flops`` (FlopCounterMode, forward).
    """
    check_config(world_size, seq_len, order, method, heads, kv_heads, block)
    q, k, v, do = inputs(batch, heads, kv_heads, seq_len, head_dim, launch.device())
    ref, (rq, rk, rv) = reference(q, k, v, causal)
    (ref * do).sum().backward()
    table = layout(world_size, seq_len, order)
    rows = rows_of(table[rank]).to(q.device)
    mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    work = dict.fromkeys(("tiles_full", "tiles_masked", "score_entries", "unmasked_entries"), 0)
    with comm.counting() as fwd, FlopCounterMode(display=False) as flops:
        out = run_method(method, *mine, table, causal, work, hand, fused, block)
    with comm.counting() as bwd:
        (out * do[:, :, rows]).sum().backward()
    errors = {"output": (out - ref[:, :, rows]).abs().max().item()}
    for name, t, r in zip(("dq", "dk", "dv"), mine, (rq, rk, rv)):
        errors[name] = (t.grad - r.grad[:, :, rows]).abs().max().item()
    nbytes = [t.numel() * t.element_size() for t in mine]
    tallies = {"forward": fwd, "backward": bwd}
    return {"errors": errors, "bytes_sent": {w: t.bytes_sent for w, t in tallies.items()},
            "messages": {w: t.calls("send") for w, t in tallies.items()},
            "calls": {w: {op: e["calls"] for op, e in t.ops.items()} for w, t in tallies.items()},
            "bytes_formula": bytes_formula(method, nbytes[0], nbytes[1], world_size, kv_heads),
            "payloads": {w: t.as_dict()["ops"] for w, t in tallies.items()},
            "work": work, "flops": flops.get_total_flops(), "rows": rows.tolist(),
            "shapes": {"q": list(mine[0].shape), "kv": list(mine[1].shape)}}


def check_many(rank, world_size, cases):
    """`check` for several keyword sets in one job: {name: result}."""
    return {name: check(rank, world_size, **kw) for name, kw in cases.items()}


def cases(world_size, seq_len=24, head_dim=8, batch=2):
    """The standard comparison (tests and notebook): every method, causal and not, both splits, with
    GQA and without; Ulysses with its KV heads split (cp | k) and copied (k = 1 < cp), fused (the
    paper's one QKV all-to-all) and not (DeepSpeed's three), by hand and by all_to_all_single; the
    ring with the kernel skipping the hidden blocks of a diagonal tile (block = 1 token). Query
    heads 6 at cp = 3, else 8, so that Ulysses can split them."""
    h, k = (6, 3) if world_size == 3 else (8, 4)
    common = dict(seq_len=seq_len, head_dim=head_dim, batch=batch)
    return {
        "ring_zigzag_gqa": dict(method="ring", order="zigzag", heads=h, kv_heads=1, **common),
        "ring_contiguous": dict(method="ring", order="contiguous", heads=h, kv_heads=h, **common),
        "ring_full": dict(method="ring", order="contiguous", causal=False, heads=h, kv_heads=k, **common),
        "ring_contiguous_blocked": dict(method="ring", order="contiguous", heads=h, kv_heads=h, block=1,
                                        **common),
        "ring_zigzag_blocked": dict(method="ring", order="zigzag", heads=h, kv_heads=h, block=1, **common),
        "allgather_zigzag_gqa": dict(method="allgather", order="zigzag", heads=h, kv_heads=1, **common),
        "allgather_contiguous": dict(method="allgather", order="contiguous", heads=h, kv_heads=h, **common),
        "ulysses_zigzag_gqa": dict(method="ulysses", order="zigzag", heads=h, kv_heads=k, **common),
        "ulysses_contiguous": dict(method="ulysses", order="contiguous", heads=h, kv_heads=h, **common),
        "ulysses_repeat": dict(method="ulysses", order="zigzag", heads=h, kv_heads=1, **common),
        "ulysses_unfused": dict(method="ulysses", order="zigzag", heads=h, kv_heads=k, fused=False, **common),
        "ulysses_library": dict(method="ulysses", order="zigzag", heads=h, kv_heads=k, hand=False, **common),
    }


def diagonal_block(cp, seq_len, order, block=None):
    """beta/c: the kernel's block on a diagonal tile over the contiguous chunk c = T/cp (beta is
    the whole chunk, c or c/2 for zig-zag, when ``block`` is None)."""
    c = seq_len // cp
    chunk = c if order == "contiguous" else c // 2
    return Fraction(min(block or chunk, chunk), c)


def work_formula(cp, order, causal=True, beta=Fraction(0), method="ring"):
    """Score entries per rank in units of c^2/2 per batch and head (c = T/cp), the kernel computing
    a diagonal tile in blocks of beta tokens (``beta`` = beta/c, `diagonal_block`). Contiguous:
    rank i computes i whole tiles and c(c + beta)/2 of the diagonal one, 2i + 1 + beta/c units;
    zig-zag: chunk a (of c/2 tokens) computes a whole chunk tiles and (c/2)(c/2 + beta)/2 of its
    own, so chunks i and 2cp-1-i together cp + beta/c units on every rank. Ulysses: every rank the
    whole triangle for a/cp heads, cp + beta/c units whatever the order."""
    if not causal:
        return [2 * cp] * cp
    if order == "contiguous" and method != "ulysses":
        return [2 * i + 1 + beta for i in range(cp)]
    return [cp + beta] * cp


def imbalance(work_per_rank):
    """max / mean of the work per rank: 1.0 when balanced."""
    return max(work_per_rank) * len(work_per_rank) / sum(work_per_rank)


def work_units(result, world_size, seq_len):
    """A rank's measured score entries in `work_formula`'s units, c^2/2 per batch and head (exact)."""
    b, a = result["shapes"]["q"][:2]
    return Fraction(2 * result["work"]["score_entries"], b * a * (seq_len // world_size) ** 2)


# ---- exercises 3 to 5 of chapter 6 (1 and 2 are sequence_parallel's) -------------------------

def min_block(peak_flops, link_bytes_per_s, kv_fraction=1.0, causal=False):
    """Liu et al. 2023, §3 (Table 2): a block of c tokens costs 4dc^2 FLOPs of attention (QK^T and PV)
    and brings 4cd bytes of K and V in bf16, so the ring hides its sends when 4dc^2/F >= 4cd/B, that is
    c >= F/B tokens per rank. With GQA only k/a of those bytes travel (``kv_fraction``): c >= (k/a) F/B.
    Under a causal mask with the zig-zag split every step after the first computes half a tile,
    2dc^2 FLOPs, against the same bytes: c >= 2F/B (``causal``)."""
    return (2 if causal else 1) * kv_fraction * peak_flops / link_bytes_per_s


def _h100_over(link, kv_fraction=1.0, causal=True):
    from labs.memory_budget import budget
    return min_block(budget.PEAK_FLOPS["H100 SXM, bf16 dense"], budget.LINKS[link], kv_fraction, causal)


IB = "InfiniBand NDR (400 Gb/s)"
EXERCISES = {
    # causal, zig-zag: half a tile per step after the first
    "3": lambda: _h100_over(IB),
    # Llama 3 70B: 8 KV of 64 heads
    "4": lambda: _h100_over(IB, kv_fraction=8 / 64),
    **crossover.EXERCISES,
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "3": [(lambda: _h100_over(IB, causal=False),
           "F/W: the full-tile condition, the causal half tiles left out"),
          (lambda: 2 * _h100_over(IB), "only Q K^T counted, hc^2 FLOPs per half tile: c >= 4F/W"),
          (lambda: _h100_over(IB) / 8, "NDR's 400 Gb/s read as 400 GB/s")],
    "4": [(lambda: _h100_over(IB), "GQA left out: exercise 3's answer"),
          (lambda: _h100_over(IB, kv_fraction=64 / 8), "a/a_kv instead of a_kv/a: the ratio inverted"),
          (lambda: _h100_over(IB, kv_fraction=8 / 64, causal=False),
           "(a_kv/a) F/W: the full-tile condition, the causal half tiles left out")],
    # at cp = 8, a = 64 the two slips give the same 1/8: one message names both
    "5": [(1 / 8, "1/cp (Ulysses' (cp-1)/cp share taken for the crossover) or cp/a (where Ulysses "
                  "starts copying KV heads), both 1/8 here"),
          (lambda: float(crossover.crossover("ring", 8, 64)), "the ring's crossover, not the all-gather's")],
}
assert 1 / 8 == 8 / 64  # 1/cp = cp/a at cp = 8, a = 64


def _tolerance(question, rel):
    """Exercise 5's ratio, 1/7, is accepted to two significant digits: 0.14 misses it by 2 %, so the
    tolerance is half a unit of the second digit over the answer (3.5 %); the nearest mistake (1/8)
    misses by 12.5 %."""
    return max(rel, 0.005 / EXERCISES["5"]()) if str(question) in ("5", "5.0") else rel


def check_answer(question, answer, rel=0.01):
    """The exercise checker (``check`` is the lab's run of one method). Exercise 5's answer is a
    ratio: of the checker's slips only a factor 2 and a percentage apply to it, not the units'."""
    from labs.measure import exercises
    slips = [(r, what) for r, what in exercises.SLIPS if what.startswith(("a factor 2", "a percentage"))]
    return exercises.check(EXERCISES, question, answer, _tolerance(question, rel), MISTAKES,
                           slips if str(question) in ("5", "5.0") else None)


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Context parallelism: ring, Ulysses or all-gather attention against one process.")
    p.add_argument("--method", choices=METHODS, default="ring")
    p.add_argument("--seq-len", type=cli.at_most(1 << 14, "tokens"), default=24)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--order", choices=ORDERS, default="contiguous")
    p.add_argument("--heads", type=cli.at_most(256, "query heads"), default=4)
    p.add_argument("--kv-heads", type=cli.positive_int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=cli.at_most(1024, "head size"), default=8)
    p.add_argument("--batch", type=cli.at_most(64, "sequences"), default=2)
    p.add_argument("--block", type=cli.positive_int, default=None,
                   help="the kernel's block on a diagonal tile, in tokens (default: the whole tile)")
    args = cli.parse(p, argv)
    kv = args.kv_heads or args.heads
    check_config(args.world_size, args.seq_len, args.order, args.method, args.heads, kv, args.block)
    # fp32 Q, K, V, dO, their gradients and one (T x T) score matrix per head, per rank, generously x4
    t, h, d = args.seq_len, args.heads, args.head_dim
    preflight.check_fits(args.world_size, 4 * 4 * args.batch * h * (8 * t * d + t * t),
                         "--seq-len or --batch")
    results = launch.launch(check, args.world_size, args.method, args.seq_len, args.causal, args.order, h, kv,
                            d, args.batch, True, True, args.block, timeout=args.timeout)
    if results is None:
        return
    work = [float(work_units(r, len(results), args.seq_len)) for r in results]
    r = {"max_abs_error": max(x["errors"]["output"] for x in results),
         "max_abs_error_grad": max(max(x["errors"][g] for g in ("dq", "dk", "dv")) for x in results),
         "bytes_sent": [x["bytes_sent"] for x in results],
         "bytes_formula": [x["bytes_formula"] for x in results], "work_per_rank": work,
         "work_max_over_mean": imbalance(work), "flops_forward": [x["flops"] for x in results],
         "world_size": len(results), "method": args.method, "order": args.order, "causal": args.causal}
    cli.report(r, args, f"{args.method} attention on cp = {len(results)} ({args.order}, "
               f"{'causal' if args.causal else 'full'}): max error {r['max_abs_error']:.1e}, grads "
               f"{r['max_abs_error_grad']:.1e}; bytes sent per rank {r['bytes_sent']}; work per rank "
               f"{work} (max/mean {r['work_max_over_mean']:.3f})")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
