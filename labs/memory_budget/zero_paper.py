"""Chapter 1: the ZeRO paper's figures, recomputed from the per-parameter formula.

Rajbhandari et al. 2019 (arXiv 1910.02054): Table 1 (GB per device by DP degree and stage, three
model sizes), every published entry checked at the precision and by the rounding rule the paper
prints it with; the bytes each rank sends per step under each stage (ring model); ZeRO++'s
cross-node bytes (Wang et al. 2023, arXiv 2306.10209); ZeRO-Offload's traffic over a link.
The formula itself, bytes per parameter by stage, is `budget.state_bytes_per_param`.
"""
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

from labs.formulas import costs
from labs.memory_budget.budget import GB, LINKS, state_bytes_per_param

def zero_comm_bytes(stage, psi, n, bytes_per_elem=2):
    """Bytes each rank sends per step (ring model): {2, 2, 2, 3} all-gather-sized passes of (N-1)/N x
    Psi x bytes (`labs.formulas.costs`; stages 0-2 all-reduce the gradients, or reduce-scatter and gather)."""
    return float((3 if stage == 3 else 2) * costs.sent("all_gather", psi * bytes_per_elem, n))


def zeropp_cross_node_bytes(psi):
    """ZeRO-3 vs ZeRO++ (Wang et al. 2023, arXiv 2306.10209) bytes across nodes per parameter pass,
    large N: all-gather weights (bf16 -> int8, qwZ), backward all-gather kept inside the node (hpZ:
    0 across), reduce-scatter gradients (bf16 -> int4, qgZ)."""
    return {"zero3": 2 * psi + 2 * psi + 2 * psi, "zeropp": 1 * psi + 0 + 0.5 * psi,
            "int8_weights_only": 1 * psi + 1 * psi + 2 * psi,   # int8 on both weight gathers
            "int8_forward_only": 1 * psi + 2 * psi + 2 * psi}   # the paper's qwZ: the forward gather


def offload_seconds(psi, link):
    """ZeRO-Offload's traffic per step: bf16 gradients to the CPU, bf16 weights back (2 + 2 bytes)."""
    return 2 * psi / LINKS[link]  # both directions at once: 2 bytes each way per parameter


# ZeRO paper (Rajbhandari et al. 2019), Table 1: GB per device (K = 12) by DP degree, for three
# model sizes, the published values. Stage 1 = P_os, 2 = P_os+g, 3 = P_os+g+p. The columns print
# by different rules, each entry at its own printed decimal places (`matches_paper` quantizes to
# them): 7.5B rounds half up (41.25 -> 41.3, 0.46875 -> 0.47); 128B and 1T truncate (513.5 -> 513,
# 4187.5 -> 4187, 15.625 -> 15.6).
ZERO_PAPER_DP = [1, 4, 16, 64, 256, 1024]
ZERO_PAPER_COLUMNS = {
    "7.5B": {"psi": 7.5e9, "printing": "round",
             1: [120, 52.5, 35.6, 31.4, 30.4, 30.1],
             2: [120, 41.3, 21.6, 16.6, 15.4, 15.1],
             3: [120, 30, 7.5, 1.88, 0.47, 0.12]},
    "128B": {"psi": 128e9, "printing": "truncate",
             1: [2048, 896, 608, 536, 518, 513],
             2: [2048, 704, 368, 284, 263, 257],
             3: [2048, 512, 128, 32, 8, 2]},
    "1T": {"psi": 1e12, "printing": "truncate",
           1: [16000, 7000, 4750, 4187, 4046, 4011],
           2: [16000, 5500, 2875, 2218, 2054, 2013],
           3: [16000, 4000, 1000, 250, 62.5, 15.6]},
}
# The 7.5B column alone, as chapter 1 first checked it; row 0 is plain data parallelism (16 Psi at
# every DP degree), which the table shows only as its DP = 1 row.
ZERO_PAPER_PSI = 7.5e9
ZERO_PAPER_TABLE1 = {"dp": ZERO_PAPER_DP, 0: [120] * 6,
                     **{stage: ZERO_PAPER_COLUMNS["7.5B"][stage] for stage in (1, 2, 3)}}


def zero_table1(psi=ZERO_PAPER_PSI):
    """Table 1 recomputed from `state_bytes_per_param`: {stage: [GB per device for each dp]}."""
    return {stage: [state_bytes_per_param(stage, dp)["total"] * psi / GB for dp in ZERO_PAPER_DP]
            for stage in (0, 1, 2, 3)}


def matches_paper(computed, published, printing="round"):
    """Equal at the decimal places the paper prints each value with, by the column's rule: "round"
    (half up, 41.25 -> 41.3) or "truncate" (toward zero, 513.5 -> 513)."""
    if printing not in ("round", "truncate"):
        raise ValueError(f"printing must be 'round' or 'truncate', got {printing!r}.")
    mode = ROUND_HALF_UP if printing == "round" else ROUND_DOWN

    def printed(c, p):
        return Decimal(repr(c)).quantize(Decimal(str(p)), rounding=mode) == Decimal(str(p))
    return len(computed) == len(published) and all(printed(c, p) for c, p in zip(computed, published))


def zero_table1_check():
    """Every published entry of Table 1 against the formula: {column: {printing, computed, published,
    matches: {stage: bool}}}; the DP = 1 row of each column is also plain data parallelism, 16 Psi."""
    out = {}
    for name, col in ZERO_PAPER_COLUMNS.items():
        table = zero_table1(col["psi"])
        out[name] = {"printing": col["printing"], "computed": {st: table[st] for st in (1, 2, 3)},
                     "published": {st: col[st] for st in (1, 2, 3)},
                     "matches": {st: matches_paper(table[st], col[st], col["printing"]) for st in (1, 2, 3)},
                     "baseline_gb": table[0][0]}
    return out
