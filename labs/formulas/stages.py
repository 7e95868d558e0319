"""Chapter 5: the stage split, the book's one: which layers each of pp ranks holds, v chunks each.

Layers go over pp * v chunks as evenly as possible, the short chunks at the two ends (where the
embedding and the head add work: chapter 5's `labs.pipeline.stage_balance` measures it), chunk c
on rank c mod pp (interleaved 1F1B's placement, Narayanan et al. 2021, §2.2).
"""
import functools


def split_counts(n, parts):
    """n items over ``parts`` as evenly as possible, the short parts first and last: 126 over 16 is
    [7, 8, ..., 8, 7]; with more short parts than two, the first end takes the extra one."""
    base, extra = divmod(n, parts)
    short = parts - extra
    first = short // 2 + short % 2 if extra else 0   # short parts at the ends, the first end first
    return [base + (first <= i < first + extra) if extra else base for i in range(parts)]


@functools.lru_cache(maxsize=None)
def stage_layers(layers, pp, v=1):
    """Layer indices of each of the pp ranks: pp * v chunks in order (`split_counts`), chunk c on rank
    c mod pp. A chunk may hold no layer only at the two ends (the embedding alone, the head alone)."""
    for name, value in (("layers", layers), ("pp", pp), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if pp * v > layers + 2:
        raise ValueError(f"{layers} layers cannot fill pp * v = {pp} * {v} = {pp * v} model chunks (at most "
                         f"{layers + 2}: only the first and the last chunk may hold no layer); use fewer.")
    out, start = [[] for _ in range(pp)], 0
    for c, size in enumerate(split_counts(layers, pp * v)):
        out[c % pp].extend(range(start, start + size))
        start += size
    return tuple(tuple(ranks) for ranks in out)
