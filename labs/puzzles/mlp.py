"""Chapter 16, puzzle 5 (chapter 4 teaches it): Megatron's MLP split, with its operators f and g.

The reader writes ``parallelize_mlp(mlp, group)``: turn the tiny GPT's MLP (``mlp.fc``, A, then
GeLU, then ``mlp.proj``, B) into this rank's tensor-parallel piece, in place: A's output columns
(``fc`` weight rows) split over ranks behind f (identity forward, all-reduce of the gradient
backward), B's input rows (``proj`` weight columns) split, followed by g (all-reduce forward,
identity backward), B's bias added once after g. Collectives go through ``comm.all_reduce`` so
they are counted. The reference is chapter 4's `labs.tensor_parallel.megatron.parallelize_mlp`.

Checked on every rank, against one process running the whole MLP in float64, with the bound a
float32 dot product of length n keeps, gamma_n sum |a_i b_i| (Higham 2002, section 3.1), taken
through both layers. One constant covers every product here: k = (5h + N + 2) u is at least gamma_n
for each length that occurs (h + 1 in fc, 4h/N + N in proj and g, h in dY = dZ B, b s in the weight
gradients; the grader asserts b s <= 5h + N + 2). With S = |x| |A|^T + |a| (the size of fc's
output H, and of GeLU's, |GeLU(z)| <= |z|) and G = |dZ| |B|, to first order in u:
- the output within k (S |B|^T + |b|);
- dH = (dZ B) * GeLU'(H): dZ B is off by k G, GeLU' is below 2 and its own slope (GeLU'') below 1
  moves it by at most k S, so dH is off by at most k (4 + S) * G elementwise (D below);
- the input's gradient dX = dH A within k D |A| (the sum over 4h adds k |dH| |A| <= 2 k G |A|);
- each weight shard's gradient against the matching rows or columns of the full one, each a sum
  over the b s tokens: fc.weight = dH^T X within k D^T |X|, fc.bias within k D^T 1, proj.weight =
  dZ^T GeLU(H) within 4 k |dZ|^T S (the sum's own k |dZ|^T S plus GeLU(H)'s error, at most
  2 k S + u |GeLU(H)| <= 3 k S, times |dZ|), proj.bias = dZ^T 1 within k |dZ|^T 1;
- a NaN is named as a NaN (`grader.nan_in`);
- the all-reduces: one in forward and one in backward, each of b s h elements, 2(N-1)/N of it
  sent (`labs.formulas.costs`).
"""
import copy
import types

import torch

from labs import model as tiny
from labs.formulas import costs
from labs.measure import comm, report
from labs.puzzles import grader

HINT_HANG = "every rank must make the same all-reduces in the same order: f's in backward, g's in forward."
U = 2.0**-24


def full_mlp(hidden):
    torch.manual_seed(0)
    return tiny.MLP(types.SimpleNamespace(hidden=hidden))


def inputs(shape, hidden):
    g = torch.Generator().manual_seed(7)
    return torch.randn(*shape, hidden, generator=g), torch.randn(*shape, hidden, generator=g)


def check(rank, world_size, fn, hidden, shape):
    """On one rank: split a copy of the MLP with the reader's function, run forward and backward."""
    mlp = copy.deepcopy(full_mlp(hidden))
    x, dz = inputs(shape, hidden)
    x.requires_grad_()
    with comm.counting() as tally:
        mlp = fn(mlp, None) or mlp
        with comm.counting() as forward:
            z = mlp(x)
        z.backward(dz)
    reduces = tally.ops.get("all_reduce", {"payloads": []})
    return {"out": z.detach(), "grad_x": x.grad, "fc": _grads(mlp.fc), "proj": _grads(mlp.proj),
            "forward_reduces": forward.calls("all_reduce"), "payloads": list(reduces["payloads"]),
            "formula_bytes": tally.formula_bytes_sent}


def _grads(layer):
    return {name: (p.detach().clone(), None if p.grad is None else p.grad.clone())
            for name, p in layer.named_parameters()}


def one_process(hidden, shape):
    mlp = full_mlp(hidden).double()
    x, dz = (t.double() for t in inputs(shape, hidden))
    x.requires_grad_()
    z = mlp(x)
    z.backward(dz)
    a, b = mlp.fc, mlp.proj
    size = x.abs() @ a.weight.abs().T + a.bias.abs()                 # S, (b, s, 4h)
    scale = size @ b.weight.abs().T + b.bias.abs()
    dh = (4 + size) * (dz.abs() @ b.weight.abs())                      # D = (4 + S) G
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731 (the b s tokens as rows)
    bounds = {"x": dh @ a.weight.abs(), ("fc", "weight"): rows(dh).T @ rows(x.abs()),
              ("fc", "bias"): rows(dh).sum(0), ("proj", "weight"): 4 * rows(dz.abs()).T @ rows(size),
              ("proj", "bias"): rows(dz.abs()).sum(0)}
    return mlp, z.detach(), x.grad, scale, bounds


def grade(fn, world_size=2, hidden=8, shape=(2, 3), deadline=15.0):
    results = grader.run(check, fn, world_size, deadline, HINT_HANG, hidden=hidden, shape=shape)
    if isinstance(results, grader.Grade):
        return results
    mlp, z, gx, scale, bounds = one_process(hidden, shape)
    k = (5 * hidden + world_size + 2) * U
    assert shape[0] * shape[1] <= 5 * hidden + world_size + 2, "k must cover the b s terms of dW"
    width = 4 * hidden // world_size
    for r, res in enumerate(results):
        grads = [(f"{layer}.{name} gradient", g) for layer in ("fc", "proj")
                 for name, (_, g) in res[layer].items()]
        for what, got in [("output", res["out"]), ("input gradient", res["grad_x"])] + grads:
            nan = grader.nan_in(r, what, got)
            if nan:
                return nan
        bad = _differs(res["out"], z, k * scale)
        if bad:
            return grader.Grade(False, [f"rank {r}'s output differs from one process: {bad}"],
                                _hint_output(res, z, mlp, world_size))
        bad = _differs(res["grad_x"], gx, k * bounds["x"])
        if bad:
            return grader.Grade(False, [f"rank {r}'s gradient of the MLP's input differs from one process: "
                                        f"{bad}"],
                                "each rank's input gradient is a partial sum over its columns of A: f's "
                                "backward all-reduces it (and g's backward leaves the gradient alone).")
        rows = slice(r * width, (r + 1) * width)
        expect = {("fc", "weight"): mlp.fc.weight.grad[rows], ("fc", "bias"): mlp.fc.bias.grad[rows],
                  ("proj", "weight"): mlp.proj.weight.grad[:, rows], ("proj", "bias"): mlp.proj.bias.grad}
        for (layer, name), want in expect.items():
            got = res[layer].get(name, (None, None))[1]
            if got is None or got.shape != want.shape:
                shape_got = None if got is None else tuple(got.shape)
                return grader.Grade(False, [f"rank {r}'s {layer}.{name} gradient has shape {shape_got}; this "
                                            f"rank's shard of it has {tuple(want.shape)}"],
                                    "fc keeps rows r*4h/N..(r+1)*4h/N of its weight and bias; proj keeps the "
                                    "same columns of its weight and all of its bias.")
            bound = bounds[layer, name]
            bound = bound[rows] if layer == "fc" else bound[:, rows] if name == "weight" else bound
            bad = _differs(got, want, k * bound)
            if bad:
                return grader.Grade(False, [f"rank {r}'s {layer}.{name} gradient differs from one process's "
                                            f"shard: {bad}"], "check which rows or columns this rank keeps.")
    return _bytes(results, world_size, hidden, shape)


def _differs(got, want, bound):
    err = (got.double() - want).abs()
    if (err <= bound).all():
        return None
    i = int((err - bound).argmax())
    got, want = got.reshape(-1)[i].item(), want.reshape(-1)[i].item()
    return (f"element {i} is {got:.4g}, one process says {want:.4g} "
            f"(off by {err.reshape(-1)[i].item():.2g})")


def _hint_output(res, z, mlp, n):
    out = res["out"].double()
    if torch.allclose(out, n * (z - mlp.proj.bias) + mlp.proj.bias, atol=1e-4):
        return "the output is N times too large: g's all-reduce ran more than once on the summed output."
    if torch.allclose(out, z + (n - 1) * mlp.proj.bias, atol=1e-4):
        return "proj's bias was added on every rank before g summed: add it once, after g."
    return ("each rank's proj output is a partial sum over its columns of A: g's forward all-reduces it "
            "before the bias is added.")


def _bytes(results, n, hidden, shape):
    numel = shape[0] * shape[1] * hidden
    m = numel * 4
    want = [m, m]
    for r, res in enumerate(results):
        if res["payloads"] != want or res["forward_reduces"] != 1:
            sent = res["formula_bytes"] - 2 * costs.sent("all_reduce", m, n)
            extra = f": {sent:,} bytes too many per rank" if sent > 0 else ""
            return grader.Grade(False, [
                f"rank {r} made {len(res['payloads'])} all-reduce(s) of {res['payloads']} bytes "
                f"({res['forward_reduces']} in forward); Megatron's MLP makes 2 of {m:,} bytes (b s h "
                f"fp32 elements), one in forward and one in backward{extra}"],
                "g all-reduces once in forward and f once in backward; call comm.all_reduce (torch's own "
                "is not counted).")
    worst = max((res["out"].double() - results[0]["out"].double()).abs().max().item() for res in results)
    return grader.Grade(True, [
        f"Megatron MLP (h = {hidden}, 4h = {4 * hidden}) split over {n} ranks",
        "output, input gradient and every shard's weight gradient: one process's within the float32 "
        f"dot-product bound; ranks agree ({report.below(worst, 1e-6)})",
        f"2 all-reduces of b s h = {numel} fp32 elements ({m:,} bytes), one in forward (g) and one in "
        f"backward (f): 2 x 2(N-1)/N M = {2 * costs.sent('all_reduce', m, n):,} bytes sent per rank"])
