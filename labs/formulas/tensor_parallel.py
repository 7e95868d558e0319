"""Chapter 4: how tensor parallelism places attention heads, as formulas: query heads split over tp,
KV heads split when tp divides them and copied when tp is a multiple of them (GQA, Ainslie et al.
2023). Chapter 4's lab runs the layout (`labs.tensor_parallel.gqa_parallel`).
"""


def kv_layout(n_head, n_kv_head, tp):
    """How a query heads and k KV heads sit on tp ranks: "split" or "replicate", per-rank counts."""
    if n_head % tp:
        raise ValueError(f"the number of query heads = {n_head} is not divisible by tp = {tp}; "
                         f"choose a tp that divides it.")
    if n_kv_head % tp == 0:
        mode, local, copies = "split", n_kv_head // tp, 1
    elif tp % n_kv_head == 0:
        mode, local, copies = "replicate", 1, tp // n_kv_head
    else:
        raise ValueError(f"{n_kv_head} KV heads cannot be split or replicated over tp = {tp}: tp "
                         f"must divide the KV heads or be a multiple of them.")
    return {"mode": mode, "q_heads_per_rank": n_head // tp, "kv_heads_per_rank": local,
            "copies_per_kv_head": copies, "kv_fraction_per_rank": local / n_kv_head}


def kv_heads_of(rank, n_kv_head, tp):
    """The KV heads rank ``rank`` holds (the ones its query heads read); `kv_layout` validated tp."""
    if n_kv_head % tp == 0:
        per = n_kv_head // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // n_kv_head)]
