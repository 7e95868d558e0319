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
all-reduce of the input gradient, the forward's rounding fed into backward); the correct layouts stay
about 50 times inside it. A bug that scales the tensor by c gives r_T = |c - 1|: 1 for a factor of 2.
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
    """Per tensor: r_T (see the module) and its tolerance, from every rank's `shards` (``per_rank``,
    with their ``coords``) and one process's step-1 gradients ``grads`` and |g|_abs ``absgrads``
    (of the mean loss over ``tokens`` tokens)."""
    sums, scale = {}, 2 * rounding.gamma(tokens, u)
    for shard, c in zip(per_rank, coords):
        for name, offset, values in shard:
            glob, cut = matching(name, c, dims, cfg)
            ref, ab = (cut(t[glob]).reshape(-1)[offset:offset + values.numel()].double()
                       for t in (grads, absgrads))
            s = sums.setdefault(glob, [0.0, 0.0, 0.0])
            s[0] += (values.double() - ref).pow(2).sum().item()
            s[1] += ref.pow(2).sum().item()
            s[2] += (scale * ab).pow(2).sum().item()
    return {n: {"ratio": (d / g) ** 0.5 if g else float("inf"),
                "tol": (a / g) ** 0.5 if g else 0.0} for n, (d, g, a) in sums.items()}


def passes(result):
    """Whether every tensor's r_T is within its tolerance (`compare`'s result)."""
    return all(v["ratio"] <= v["tol"] for v in result.values())
