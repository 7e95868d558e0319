"""Chapter 6: which context-parallel method sends the fewest bytes at a given KV-head ratio rho = k/a.

Per rank, forward and backward, with q the bytes of a rank's Q block (T/cp tokens) and
kappa = rho q those of its K block (the derivations of `ring_attention.ring_bytes`,
`allgather_cp.allgather_bytes` and `ulysses.ulysses_bytes`):

    ring        (6cp - 4) rho q            (K, V forward; K, V, dK, dV backward, and dK, dV home)
    all-gather  4(cp - 1) rho q            (gather K, V; reduce-scatter dK, dV)
    Ulysses     4(cp - 1)(1 + rho') q / cp, rho' = max(k, cp)/a  (Q, K, V, O each way; the KV heads
                                           copied up to cp when k < cp)

Without copies (k >= cp), Ulysses sends fewer bytes than the all-gather when rho > 1/(cp - 1)
and fewer than the ring when rho > 2(cp - 1)/(3cp^2 - 4cp + 2); the all-gather always sends
fewer than this lab's ring. With copies, Ulysses' bytes stop falling at k = cp, and the
crossover with method m moves to where m's bytes meet Ulysses' at rho' = cp/a (`crossover`).
`sweep_cases` are the runs that count them at several k.
"""
from fractions import Fraction


def bytes_per_rank(method, rho, cp, heads):
    """Forward + backward bytes per rank in units of q (a Fraction), ``rho`` = k/a."""
    rho = Fraction(rho)
    if method == "ring":
        return (6 * cp - 4) * rho
    if method == "allgather":
        return 4 * (cp - 1) * rho
    sent_kv = max(rho, Fraction(cp, heads))                          # KV heads copied up to cp
    return Fraction(4 * (cp - 1), cp) * (1 + sent_kv)


def crossover(method, cp, heads):
    """The ratio rho = k/a above which Ulysses sends fewer bytes than ``method`` (ring or allgather).

    Both sides are linear in rho: m's bytes are c_m rho, Ulysses' 4(cp-1)(1 + max(rho, cp/a))/cp.
    Solved first without copies; if that rho lies below cp/a, Ulysses' bytes there are those of
    rho = cp/a, and the crossover is where c_m rho reaches them."""
    c_m = bytes_per_rank(method, 1, cp, heads)
    u = Fraction(4 * (cp - 1), cp)
    rho = u / (c_m - u)                                              # c_m rho = u (1 + rho)
    floor = Fraction(cp, heads)
    return rho if rho >= floor else u * (1 + floor) / c_m


def winner(rho, cp, heads):
    """The method that sends the fewest bytes per rank at ``rho`` (ties to the earlier name)."""
    return min(("allgather", "ring", "ulysses"), key=lambda m: bytes_per_rank(m, rho, cp, heads))


def sweep_cases(cp, heads=8, kv_heads=(1, 2, 4, 8), seq_len=24, head_dim=8, batch=2):
    """Every method at every KV-head count, the same query heads and split (zig-zag, causal), for
    `labs.context_parallel.methods.check_many`: the bytes compared at equal k/a."""
    common = dict(seq_len=seq_len, head_dim=head_dim, batch=batch, heads=heads, order="zigzag")
    return {f"{m}_k{k}": dict(method=m, kv_heads=k, **common)
            for k in kv_heads for m in ("ring", "allgather", "ulysses")}


# ---- exercise 5 of chapter 6 -------------------------------------------------------------------

EXERCISES = {
    # cp = 8, 64 query heads: k/a above which Ulysses wins
    "5": lambda: float(crossover("allgather", 8, 64)),
}
