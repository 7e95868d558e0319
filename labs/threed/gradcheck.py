"""Chapter 17: the step-1 gradient check, which sees a gradient's scale where Adam's step does not.

Adam's step m^/(sqrt(v^) + eps) is the same for g and c g (up to eps), element by element, so any
bug that scales a whole tensor's gradient by a constant moves no loss: the summed gradient over
replicas, or a replicated LayerNorm's gradient summed over tp instead of averaged. This check
compares, at step 1, the gradient the optimizer receives on every rank (its ZeRO-1 shard, reduced:
`shards`) with the matching slice of one process's gradient (`matching`), per whole tensor:

    r_T = ||g_layout - g_one|| / ||g_one||    over every element of tensor T, on every rank.

The tolerance is the fp32 reordering bound the drift bound uses for gradients (`labs.threed.drift`):
each element's sum over the N tokens, in another order, moves it by at most 2 gamma_N |g|_abs, so
r_T <= ||2 gamma_N |g|_abs|| / ||g_one||, to first order. It omits what the drift bound omits (TP's
all-reduce of the input gradient, CP's reduce-scatter of dK and dV, the forward's rounding fed into
backward). A bug that scales the
tensor by c gives r_T = |c - 1|: 1 for a factor of 2.

A check over what the ranks report would pass a tensor no rank reports, or judge one on the slices
some rank happened to report: `compare` also counts, per element of every tensor of one process's
model, how many ranks' shards hold it (replicated tensors, such as tp's LayerNorms, more than once),
and `passes` requires every element held at least once.
"""
import torch

from labs.tensor_parallel import megatron
from labs.threed import rounding


@torch.no_grad()
def shards(opt, piece):
    """This rank's step-1 gradient as the optimizer gets it (reduced over its ZeRO-1 group: the
    reduce-scatter the step would run anyway, cached for it): [(local name, offset in the
    parameter's flat elements, values)]."""
    names = {id(p): n for n, p in piece.named_parameters()}
    out = []
    for b, grad in zip(opt.buckets, opt.reduce_grads()):
        for p, _, first, last in b.pieces:
            if p in opt.got_grad:
                offset = first + b.lo - b.start[p]
                k = min(last - first, p.numel() - offset)        # the padding is no parameter's
                out.append((names[id(p)], offset, grad[first:first + k].clone()))
    return out


def matching(name, coords, dims, cfg):
    """The global name of a rank's parameter ``name``, and a function that cuts from a full-model
    tensor of that name the slice this rank holds (its pipeline stage's layers, its TP rows or columns)."""
    parts = name.split(".")
    if parts[0] == "blocks":
        parts[1] = str(int(parts[1]) + coords["pp"] * cfg.n_layer // dims.pp)
    glob = ".".join(p for p in parts if p != "table")             # CP's Positions wraps the table
    if parts[0] != "blocks" or dims.tp == 1:
        return glob, lambda full: full
    h, tp, r = cfg.hidden, dims.tp, coords["tp"]
    qkv, mlp = megatron.qkv_rows(h, cfg.n_head, tp, r), megatron.shard_rows(4 * h, tp, r)
    layer = ".".join(parts[2:])
    for k, idx in {"attn.qkv": qkv, "mlp.fc": mlp}.items():          # column-parallel: rows
        if layer.startswith(k):
            return glob, lambda full, idx=idx: full[idx]
    cols = {"attn.proj.weight": qkv[:h // tp], "mlp.proj.weight": mlp}  # row-parallel: columns
    return glob, (lambda full: full[:, cols[layer]]) if layer in cols else (lambda full: full)


def compare(per_rank, coords, dims, cfg, grads, absgrads, tokens, u=2.0 ** -24):
    """Per tensor of one process's model (every name in ``grads``): r_T (see the module), its tolerance
    and ``covered``, the fraction of its elements some rank's shard holds; from every rank's `shards`
    (``per_rank``, with their ``coords``) and one process's step-1 gradients ``grads`` and |g|_abs
    ``absgrads`` (of the mean loss over ``tokens`` tokens). A tensor no rank reports: ratio inf,
    covered 0."""
    sums, scale = {n: [0.0, 0.0, 0.0] for n in grads}, 2 * rounding.gamma(tokens, u)
    held = {n: torch.zeros(t.numel(), dtype=torch.long) for n, t in grads.items()}
    for shard, c in zip(per_rank, coords):
        for name, offset, values in shard:
            glob, cut = matching(name, c, dims, cfg)
            if glob not in grads:
                raise KeyError(f"{name} (rank at {c}) is {glob}, no tensor of one process's model")
            k = values.numel()
            ref, ab = (cut(t[glob]).reshape(-1)[offset:offset + k].double() for t in (grads, absgrads))
            where = cut(torch.arange(grads[glob].numel()).reshape(grads[glob].shape)).reshape(-1)
            held[glob][where[offset:offset + k]] += 1               # the same cut, on the indices
            s = sums[glob]
            s[0] += (values.double() - ref).pow(2).sum().item()
            s[1] += ref.pow(2).sum().item()
            s[2] += (scale * ab).pow(2).sum().item()
    out = {}
    for n, (d, g, a) in sums.items():
        covered = (held[n] > 0).double().mean().item() if held[n].numel() else 1.0
        out[n] = {"ratio": (d / g) ** 0.5 if g else (0.0 if covered and not d else float("inf")),
                  "tol": (a / g) ** 0.5 if g else 0.0, "covered": covered}
    return out


def refused(result):
    """The tensors of `compare`'s result that fail: not every element held by some rank, or
    r_T beyond its tolerance."""
    return sorted(n for n, v in result.items() if v["covered"] < 1 or v["ratio"] > v["tol"])


def excess(v):
    """r_T over its tolerance for one tensor of `compare`'s result: inf where not every element
    was held, or where the tolerance is 0 and r_T is not."""
    if v["covered"] < 1:
        return float("inf")
    return v["ratio"] / v["tol"] if v["tol"] else (0.0 if v["ratio"] == 0 else float("inf"))


def passes(result):
    """Whether every tensor of one process's model was compared in full and is within its tolerance
    (`compare`'s result); an empty result passes nothing."""
    return bool(result) and not refused(result)
