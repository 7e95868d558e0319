"""Chapter 7: the all-to-all's tail under routing imbalance: the slowest rank's bytes against the mean.

An all-to-all ends when its last byte lands, so a rank that receives more than the others sets its
time: with skewed routing, the rank holding the popular experts. Under a router whose top-k
choices are k draws without replacement from p (Gumbel top-k: argtop-k_i (log p_i + G_i)), expert i
is among a token's k choices with probability pi_i; for k = 2, pi_i = p_i + sum_{j != i} p_j p_i /
(1 - p_j). Rank r holds the experts E_r and, from each of the other ep - 1 ranks' T tokens, receives
T * sum_{i in E_r} pi_i rows in expectation. The mean over ranks is T k (ep - 1) / ep rows, so

    slowest / mean = ep * max_r sum_{i in E_r} pi_i / k,

1 under uniform routing, up to ep when one rank holds every chosen expert. The lab routes Zipf-skewed
batches (p_i proportional to 1 / i^zeta) through `router.route` on every rank, sends the rows with
`moe.exchange` (the layer's all-to-all), reads each rank's bytes per destination from the payloads,
and sums what every rank received, for experts placed contiguously (rank r holds r N/ep, ...: the
popular experts together) and strided (rank r holds r, r + ep, ...).
"""
import torch

from labs.expert_parallel import moe, moe_routing, router
from labs.launcher import launch

PLACEMENTS = ("contiguous", "strided")


def owner(experts, ep, placement):
    """(N,) the rank that holds each expert."""
    e = torch.arange(experts)
    return e // (experts // ep) if placement == "contiguous" else e % ep


def inclusion(p, top_k):
    """pi_i: the probability that expert i is among k draws without replacement from p (k = 1 or 2)."""
    if top_k == 1:
        return p.clone()
    if top_k != 2:
        raise ValueError(f"the inclusion formula here is for k = 1 or 2, got k = {top_k}; use k <= 2.")
    second = (p[None, :] * p[:, None] / (1 - p[:, None])).sum(0) - p * p / (1 - p)   # sum over j != i
    return p + second


def derived_ratio(p, ep, top_k, placement):
    """Slowest rank's received rows over the mean, in expectation: ep * max_r sum_{i on r} pi_i / k."""
    pi = inclusion(p, top_k)
    per_rank = torch.zeros(ep, dtype=pi.dtype).index_add(0, owner(len(p), ep, placement), pi)
    return (ep * per_rank.max() / top_k).item(), per_rank


def sent_bytes(rank, world_size, skews=(0.0, 0.5, 1.0, 1.5), tokens=256, hidden=16, experts=8, top_k=2,
               batches=4, seed=0):
    """Per skew and placement: bytes this rank's dispatch sent to each destination, summed over
    ``batches`` batches (read from the payloads), and the smallest routing margin."""
    dev, out = launch.device(), {}
    moe.check_ep(experts, world_size)
    for zeta in skews:
        probs = moe_routing.zipf_probs(experts, zeta)
        g = torch.Generator().manual_seed(seed + 1000 * rank + int(100 * zeta))
        logits = [moe_routing.skewed_logits(tokens, probs, g) for _ in range(batches)]
        for placement in PLACEMENTS:
            where = owner(experts, world_size, placement).to(dev)
            total, margin = [0] * world_size, float("inf")
            for lg in logits:
                r = router.route(lg.to(dev), top_k)
                margin = min(margin, r.margin)
                dest = where[r.idx.reshape(-1)]                              # (T*k,) destination of each row
                o = torch.argsort(dest, stable=True)
                x = torch.randn(tokens, hidden, generator=g).to(dev)               # (T, h)
                # a row per (token, choice)
                rows = x[(torch.arange(tokens * top_k, device=dev) // top_k)[o]]
                send = torch.bincount(dest, minlength=world_size)
                recv = moe.exchange(send, [1] * world_size, [1] * world_size, None, "splits").tolist()
                with moe.payloads() as log:
                    moe.exchange(rows, recv, send.tolist(), None, "dispatch")
                total = [a + (b if d != rank else 0) for d, (a, b) in enumerate(zip(total, log[0]["to"]))]
            out[(zeta, placement)] = {"sent_to": total, "routing_margin": margin, "row_bytes": hidden * 4}
    return out


def tail_table(results, skews, tokens=256, experts=8, top_k=2, batches=4):
    """From every rank's `sent_bytes`: per skew and placement, the bytes each rank received, the
    slowest over the mean (measured), the same derived from pi, and the statistical bound the
    per-rank totals must meet (each token sends at most k rows to a rank, so the variance of a rank's
    received rows is at most k times their mean: four standard deviations)."""
    ep, rows = len(results), []
    for zeta in skews:
        p = moe_routing.zipf_probs(experts, zeta)
        for placement in PLACEMENTS:
            got = [sum(r[(zeta, placement)]["sent_to"][d] for r in results) for d in range(ep)]
            row = results[0][(zeta, placement)]["row_bytes"]
            ratio, per_rank = derived_ratio(p, ep, top_k, placement)
            expected = [batches * (ep - 1) * tokens * q.item() * row for q in per_rank]
            worst = max(abs(g_ - e) / row / (4 * (top_k * e / row) ** 0.5) for g_, e in zip(got, expected))
            rows.append({"skew": zeta, "placement": placement, "received": got,
                         "measured_ratio": max(got) / (sum(got) / ep), "derived_ratio": ratio,
                         "worst_in_bounds": worst,
                         "routing_margin": min(r[(zeta, placement)]["routing_margin"] for r in results)})
    return rows


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("The all-to-all's slowest rank under Zipf-skewed routing: received bytes counted "
                   "against the derivation.", world_size_default=4)
    p.add_argument("--skews", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5], help="Zipf exponents zeta")
    args = cli.parse(p, argv)
    if any(s < 0 for s in args.skews):
        raise ValueError(f"a Zipf exponent is 0 or more, got {min(args.skews)}; give --skews like 0 0.5 1.")
    moe.check_ep(8, args.world_size)
    results = launch.launch(sent_bytes, args.world_size, tuple(args.skews), timeout=args.timeout)
    if results is None:
        return
    rows = tail_table(results, tuple(args.skews))
    result = {"rows": [{k: r[k] for k in ("skew", "placement", "measured_ratio", "derived_ratio")}
                       for r in rows],
              "world_size": len(results)}
    cli.report(result, args, "\n".join(f"s = {r['skew']:g}, {r['placement']:10s}: slowest/mean "
                                       f"{r['measured_ratio']:.2f} measured, {r['derived_ratio']:.2f} derived"
                                       for r in rows))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
