"""Chapter 10: every collective built from point-to-point messages, counted against its cost formula.

The algorithms are `labs.collectives.algorithms`; this file checks each one: its result against
the library's collective, its rounds and bytes against the formula below, and times the library's
collectives nccl-tests style (``bench``, `labs.collectives.alpha_beta`).

Each algorithm's rounds and bytes on p ranks for n bytes, after Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 19(1), 2005; TRG), and, for
the ring all-reduce, Patarasuk & Yuan (2009) (time = rounds * alpha + bytes * beta, plus gamma
per reduced byte):

    broadcast, binomial tree        ceil(lg p) rounds; the root sends n each round
    reduce, binomial tree           ceil(lg p) rounds; the root receives n each round
    all-gather / reduce-scatter     ring: p-1 rounds; recursive doubling / halving: lg p rounds;
                                    both send (p-1)/p * n per rank (n: the full buffer)
    all-reduce                      ring (RS then AG; Patarasuk & Yuan): 2(p-1) rounds, 2(p-1)/p * n
                                    recursive doubling: lg p rounds, n lg p per rank
                                    Rabenseifner (halving RS then doubling AG): 2 lg p rounds,
                                    2(p-1)/p * n per rank
    all-to-all, pairwise exchange   p-1 rounds, (p-1)/p * n per rank

Recursive doubling and halving pair rank r with r XOR 2^k, so they need a power of two; on any other
p, with p2 = 2^floor(lg p) and r = p - p2, the first 2r ranks fold pairwise onto p2 and unfold at
the end (MPICH's whole-buffer fold; TRG 2005, section 4, swap half-buffers): two more rounds,
and the folded data sent twice
(`labs.collectives.recursive`, `formula`). Every message goes through `labs.measure.comm`, so
`bytes_sent` are counted messages, and `rounds` are the exchanges a rank took part in, counted by
one `Rounds` for every algorithm. Chapter 2's ring (`labs.data_parallel.hand_ring`), separate code,
is the second all-reduce `rank_rs_then_ag` compares the ring halves with.

    python -m labs.collectives.toolkit --world-size 4 --op all_reduce --algorithm recursive_doubling --json
    python -m labs.collectives.toolkit bench --world-size 2
"""
import math

import torch
import torch.distributed as dist

from labs.measure import comm
from labs.launcher import launch, preflight
from labs.collectives import algorithms, alpha_beta, recursive
from labs.collectives.recursive import Rounds
from labs.data_parallel import hand_ring

def formula(op, algorithm, p, n):
    """The rounds and bytes for ``n`` bytes (the full buffer) on ``p`` ranks: the most any rank
    sends (``max_bytes_sent``) and all ranks together (``total_bytes_sent``). The recursive
    algorithms on p = p2 + r ranks (p2 = 2^floor(lg p)) are `_folded`'s."""
    check(op, algorithm, p, n)
    lg = math.ceil(math.log2(p))
    share = (p - 1) * n // p
    if algorithm.startswith("recursive") or algorithm == "rabenseifner":
        return _folded(op, algorithm, p, n)
    return {("broadcast", "tree"): (lg, lg * n, (p - 1) * n), ("reduce", "tree"): (lg, n, (p - 1) * n),
            ("all_gather", "ring"): (p - 1, share, (p - 1) * n),
            ("reduce_scatter", "ring"): (p - 1, share, (p - 1) * n),
            ("all_reduce", "ring"): (2 * (p - 1), 2 * share, 2 * (p - 1) * n),
            ("all_to_all", "pairwise"): (p - 1, share, (p - 1) * n)}[op, algorithm]


def _folded(op, algorithm, p, n):
    """Rounds, most bytes one rank sends, and all bytes, with r ranks folded onto p2 = 2^lg2 (MPICH's
    whole-buffer fold): the fold and the unfold are one round each and carry, per folded pair, the whole
    buffer n (all-reduce, reduce-scatter's fold, all-gather's unfold) or one block k = n/p. In the
    all-gather and reduce-scatter virtual rank v speaks for blocks [s(v), s(v+1)), s(v) = v + min(v, r)."""
    p2, r = recursive.layout(p)
    lg2, k, extra = p2.bit_length() - 1, n // p, int(r > 0)
    s = [v + min(v, r) for v in range(p2 + 1)]
    masks = [1 << j for j in range(lg2)]
    if algorithm == "recursive_doubling" and op == "all_reduce":   # lg2 swaps of n, and the unfold
        return lg2 + 2 * extra, (lg2 + extra) * n, 2 * r * n + p2 * lg2 * n
    if algorithm == "rabenseifner":   # the ring's bytes over p2 equal blocks, and the unfold
        return 2 * lg2 + 2 * extra, 2 * (p2 - 1) * n // p2 + extra * n, 2 * r * n + 2 * (p2 - 1) * n
    if op == "all_gather":    # virtual rank 0 (two blocks if r > 0) holds the most every round
        most = k * sum(s[m] for m in masks) + extra * n
        return lg2 + 2 * extra, most, r * k + (p2 - 1) * n + r * n
    if op == "reduce_scatter":   # in round m virtual rank v sends its partner's half, of the 2m-group
        half = [sum(k * (s[b + m] - s[b]) for m in masks for b in [((v ^ m) // m) * m]) for v in range(p2)]
        most = max([extra * n] + [h + k * (v < r) for v, h in enumerate(half)])
        return lg2 + 2 * extra, most, r * n + (p2 - 1) * n + r * k
    raise AssertionError(op)


def check(op, algorithm, p, numel):
    """Refuse, in one sentence, what the algorithm cannot do, before any rank starts."""
    if op not in algorithms.CHOICES:
        raise ValueError(f"unknown collective {op!r}; use one of {', '.join(algorithms.OPS)}.")
    if algorithm not in algorithms.CHOICES[op]:
        raise ValueError(f"{op} is built here as {' or '.join(algorithms.CHOICES[op])}, not {algorithm!r}.")
    preflight.check_world_size(p)
    if op not in ("broadcast", "reduce") and numel % p:
        raise ValueError(f"{op} splits the buffer into {p} equal blocks: make the element count "
                         f"{numel} a multiple of {p}.")
    p2 = recursive.layout(p)[0]
    if algorithm == "rabenseifner" and numel % p2:
        raise ValueError(f"Rabenseifner on {p} ranks folds onto {p2} and splits the buffer into {p2} "
                         f"equal blocks: make the element count {numel} a multiple of {p2}.")


def _inputs(op, numel, p, r):
    """This rank's input (seeded by rank: every rank's differs) and an output buffer."""
    g = torch.Generator().manual_seed(1000 + r)
    size = numel // p if op == "all_gather" else numel
    x = torch.randn(size, generator=g).to(launch.device())
    out = {"all_gather": numel, "reduce_scatter": numel // p, "all_to_all": numel}.get(op)
    return x, (None if out is None else torch.empty(out, device=x.device))


def _library(op, x, out):
    """The library's answer for the same inputs (not counted: outside the tally)."""
    ref, ref_out = x.clone(), None if out is None else torch.empty_like(out)
    if op == "broadcast":
        dist.broadcast(ref, 0)
    elif op == "reduce":
        dist.reduce(ref, 0)
    elif op == "all_reduce":
        dist.all_reduce(ref)
    else:
        {"all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter,
         "all_to_all": comm.all_to_all}[op](ref_out, ref)
        return ref_out
    return ref


def rank_run(rank, world_size, op, algorithm, numel):
    """One rank: the hand collective beside the library's; its error, rounds and counted bytes."""
    x, out = _inputs(op, numel, world_size, rank)
    expected = _library(op, x, out)
    rounds, mine = Rounds(), x.clone()
    with comm.counting() as tally:
        hand = algorithms.HAND[op, algorithm]
        got = hand(mine, rounds) if out is None else hand(out, mine, rounds)
    compare = op != "reduce" or rank == 0   # reduce leaves the sum on the root only
    err = (got - expected).abs().max().item() if compare and got.numel() else 0.0
    return {"max_abs_error": err, "rounds": rounds.count, "bytes_sent": tally.bytes_sent,
            "bytes_received": tally.bytes_received, "schedule": rounds.log}


def run(op, algorithm, world_size, numel, timeout=120.0):
    """Spawn ``world_size`` ranks; the hand collective against the library's and against `formula`.

    Returns op, algorithm, world_size, numel, nbytes (the full buffer, fp32), max_abs_error (max over
    ranks), steps (max rounds over ranks), bytes_sent (per rank, counted), total_bytes_sent and
    formula (the cost formula's rounds, max_bytes_sent, total_bytes_sent)."""
    check(op, algorithm, world_size, numel)
    ranks = launch.spawn(rank_run, world_size, op, algorithm, numel, timeout=timeout)
    return summarize(ranks, op, algorithm, numel)


def summarize(ranks, op, algorithm, numel):
    p, n = len(ranks), 4 * numel
    rounds, most, total = formula(op, algorithm, p, n)
    sent = [r["bytes_sent"] for r in ranks]
    return {"op": op, "algorithm": algorithm, "world_size": p, "numel": numel, "nbytes": n,
            "max_abs_error": max(r["max_abs_error"] for r in ranks),
            "steps": max(r["rounds"] for r in ranks), "bytes_sent": sent, "total_bytes_sent": sum(sent),
            "schedule": [r["schedule"] for r in ranks],
            "formula": {"steps": rounds, "max_bytes_sent": most, "total_bytes_sent": total}}


def rank_rs_then_ag(rank, world_size, numel):
    """One rank: ring reduce-scatter then ring all-gather, against two all-reduces not built from them.

    The inputs are small integers held in fp32: every partial sum is an integer far below 2^24, so
    any order of additions gives the same bits, and RS then AG must equal the library's all-reduce
    and chapter 2's ring (`hand_ring.ring_allreduce`, its own code) exactly, or it has a bug. Also
    each phase's rounds and counted bytes, and chapter 2's ring's counted bytes."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(-8, 9, (numel,), generator=g).float().to(launch.device())
    library, chapter2 = x.clone(), x.clone()
    dist.all_reduce(library)
    with comm.counting() as ring2:
        hand_ring.ring_allreduce(chapter2)
    block, out = torch.empty(numel // world_size, device=x.device), torch.empty(numel, device=x.device)
    rs_rounds, ag_rounds = Rounds(), Rounds()
    with comm.counting() as rs:
        algorithms.ring_reduce_scatter(block, x, rs_rounds)
    with comm.counting() as ag:
        algorithms.ring_all_gather(out, block, ag_rounds)
    return {"equals_library": torch.equal(out, library),      # integer sums: exact in any order
            "equals_chapter2_ring": torch.equal(out, chapter2), "rs_rounds": rs_rounds.count,
            "ag_rounds": ag_rounds.count, "rs_bytes": rs.bytes_sent, "ag_bytes": ag.bytes_sent,
            "chapter2_ring_bytes": ring2.bytes_sent}


def rank_every(rank, world_size, numel):
    """One rank: `rank_run` for every (op, algorithm), keyed "op/algorithm"."""
    return {f"{op}/{alg}": rank_run(rank, world_size, op, alg, numel) for op, alg in algorithms.HAND}


def every(world_size, numel, timeout=120.0):
    """`run` for every (op, algorithm), in one spawn: {"op/algorithm": result}."""
    ranks = launch.spawn(rank_every, world_size, numel, timeout=timeout)
    return {key: summarize([r[key] for r in ranks], *key.split("/"), numel) for key in ranks[0]}


# Chapter 10's exercises: the answers are computed here, so the book never types them.
EXERCISES = {
    "1": lambda: formula("all_reduce", "ring", 8, 2 ** 30)[1],                 # bytes one rank sends
    "2": lambda: formula("all_reduce", "recursive_doubling", 8, 2 ** 20)[1],   # bytes one rank sends
    "3": lambda: alpha_beta.crossover(5e-6, 1 / 25e9, 16),                     # n*, bytes
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "1": [(2 ** 30, "the payload M for what the ring sends, 2(N-1)/N M"),
          (2 * 2 ** 30, "2M: the ring's (N-1)/N left out"),
          (lambda: formula("all_reduce", "ring", 8, 2 ** 30)[1] / 2 ** 30 * 1e9,
           "GB for GiB: M is 2^30 bytes, not 10^9")],
    "2": [(lambda: formula("all_reduce", "ring", 8, 2 ** 20)[1],
           "the ring's 2(N-1)/N M for doubling's M lg N"),
          (2 ** 20, "one swap of M: the lg N rounds left out")],
    "3": [(lambda: (2 * 15 - 4) * 5e-6 * 25e9,
           "the rounds saved times alpha/beta, without the bytes' lg N - 2(N-1)/N"),
          (lambda: (16 - 1 - 4) * 5e-6 * 25e9 / (4 - 2 * 15 / 16),
           "the ring's N-1 rounds (one half) for its 2(N-1)")],
}


def check_answer(question, answer, rel=0.01):
    from labs.measure import exercises
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES)


def main(argv=None):
    from labs.launcher import cli
    argv = list(__import__("sys").argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        p = cli.parser("The library's collectives timed, nccl-tests style: size, time, algbw, busbw.")
        p.add_argument("--repeats", type=cli.positive_int, default=9)
        p.add_argument("--sizes", type=cli.positive_int, nargs="+", default=alpha_beta.BENCH_SIZES,
                       help="full-buffer sizes in bytes, each a multiple of 4 x world size "
                            "(default: 4 KiB to 8 MiB; on GPUs add 67108864 268435456 1073741824)")
        args = cli.parse(p, argv[1:])
        result = alpha_beta.bench(args.world_size, sizes=args.sizes, repeats=args.repeats,
                                  timeout=args.timeout)
        return cli.report(result, args, alpha_beta.table(result))
    p = cli.parser("A collective built from point-to-point messages, against the library's and its "
                   "cost formula.")
    p.add_argument("--op", choices=algorithms.OPS, default="all_reduce")
    p.add_argument("--algorithm",
                   choices=sorted({a for v in algorithms.CHOICES.values() for a in v} | {"tree"}),
                   default=None, help="default: the first one the op has (ring where there is one)")
    p.add_argument("--numel", type=cli.positive_int, default=1024, help="elements of the full buffer")
    args = cli.parse(p, argv)
    algorithm = args.algorithm or algorithms.CHOICES[args.op][0]
    result = run(args.op, algorithm, args.world_size, args.numel, timeout=args.timeout)
    f = result["formula"]
    cli.report(result, args, f"{args.op} ({algorithm}) on {result['world_size']} ranks, {result['nbytes']} "
               f"bytes: max error {result['max_abs_error']:.1e}; {result['steps']} steps (formula "
               f"{f['steps']}); most bytes sent by one rank {max(result['bytes_sent'])} (formula "
               f"{f['max_bytes_sent']})")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
