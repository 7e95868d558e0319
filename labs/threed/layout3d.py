"""Chapter 17: the layouts the 3D and 4D labs accept, their data, one process's run, the bytes predicted.

A layout is a `labs.dims.ParallelDims` of four degrees, dp x pp x cp x tp = world_size (Llama 3's
order, tp fastest), which checks them; `check` refuses one that does not divide the model, in one
sentence, before any process starts. Every layout trains the same tiny GPT on the same tokens:
at step t data-parallel replica d takes micro-batches d*m .. d*m + m - 1 of that step, each of b
sequences; a context-parallel rank keeps its zig-zag rows of every sequence (chapter 6). `reference`
is one process taking all dp*m micro-batches of each step, the run every layout is held to.

`predict_bytes_per_group` is the traffic this layout must send, per rank per step, from the shapes alone and
the earlier chapters' formulas (fp32 elements of E bytes, ring collectives of Patarasuk & Yuan 2009):

    tp  4 all-reduces per layer per micro-batch (Megatron's g twice forward, f twice backward,
        Shoeybi et al. 2019, section 3), each of M = b (s/cp) h elements: L/pp * m * 4 * 2(tp-1)/tp * M
    cp  per layer per micro-batch, K and V all-gathered forward and dK, dV reduce-scattered
        backward (all-gather CP, Llama 3 section 3.3.2), each rank sending (cp-1) blocks of
        b (s/cp) h/tp elements per tensor: L/pp * m * 4 (cp-1) b (s/cp) h/tp
    pp  one activation forward and one gradient back per micro-batch and stage boundary (chapter 5),
        b (s/cp) h elements each: a stage sends m of them to each neighbour it has
    dp  ZeRO-1 (Rajbhandari et al. 2019, section 5.1) over the dp*cp ranks that saw other tokens:
        one reduce-scatter of the gradients and one all-gather of the updated shards per step,
        each sending (n-1)/n of the rank's P_local parameters padded to a multiple of n (`formulas.costs`)

Everything is sent as it is: no scatter-gather of the pipeline messages over the TP ranks
(Narayanan et al. 2021, section 4.1, which would send 1/tp of each) and no overlap.
"""
import contextlib

import torch

from labs import model as tiny
from labs.context_parallel import methods
from labs.formulas import costs
from labs.tensor_parallel import megatron

AXES = ("dp", "tp", "pp", "cp")   # the degrees a 3D/4D run takes
FP32 = 4
# The chapter's run: 3 Adam steps of m = 2 micro-batches of b = 1 sequence per replica. Few tokens
# keep the drift bound tight (it grows with the tokens a gradient adds up, `labs.threed.drift`).
STEPS, LR, MICRO_BATCH, MICROBATCHES = 3, 1e-2, 1, 2
# The variant trained with Adam's coupled weight decay (L2: lambda w added to the gradient before
# the moments, torch.optim.Adam's weight_decay), the setting in which a gradient's scale shows.
WEIGHT_DECAY = 0.1
# Run k (the notebook's is k = 0) trains the model of seed k on the batches of seeds
# 10,000 t + i + SEED_STRIDE k at step t: the planted bugs are checked over several such runs.
SEED_STRIDE = 1_000_000


def config():
    """4 layers, 4 heads, h = 32, s = 16, V = 64: pp in {1, 2, 4}, tp in {1, 2, 4}, cp in {1, 2, 4, 8}."""
    return tiny.GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=4, hidden=32)


def check(cfg, dims, micro_batch=2, num_microbatches=4):
    """``dims`` (a `ParallelDims`, its degrees already checked) if it fits the model, or one sentence
    saying which degree does not divide it."""
    for name, value in (("micro_batch", micro_batch), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if dims.ep != 1 or dims.dp_replicate != 1:
        raise ValueError("the 3D/4D runs take dp, tp, pp and cp only (no ep, no HSDP).")
    megatron.check_degree(cfg, dims.tp)
    if cfg.n_layer % dims.pp:
        raise ValueError(f"the {cfg.n_layer} layers do not split into pp = {dims.pp} equal stages; "
                         "choose a pp that divides the layer count.")
    if cfg.seq_len % (2 * dims.cp):
        raise ValueError(f"the zig-zag split cuts each sequence into 2 cp = {2 * dims.cp} chunks: seq_len = "
                         f"{cfg.seq_len} is not divisible by {2 * dims.cp}; choose a cp with 2 cp dividing "
                         "it.")
    return dims


def cp_rows(seq, cp, rank):
    """The positions context-parallel rank ``rank`` keeps: its zig-zag chunks i and 2cp-1-i."""
    return methods.rows_of(methods.layout(cp, seq, "zigzag")[rank]) if cp > 1 else torch.arange(seq)


def step_batches(cfg, step, dp, m, micro_batch, seed=0):
    """All dp*m micro-batches of one step of run ``seed``, replica-major: replica d's are [d*m, (d+1)*m)."""
    return [tiny.synthetic_batch(cfg, micro_batch, seed=10_000 * step + i + SEED_STRIDE * seed)
            for i in range(dp * m)]


def reference(cfg, dp, m, micro_batch, steps, lr, watch=None, weight_decay=0.0, seed=0):
    """One process, fp32, one intra-op thread (as each rank): every micro-batch of a step, each
    loss divided by dp*m before its backward, gradients accumulated, one Adam step (with coupled
    weight decay ``weight_decay``, as torch.optim.Adam's), on run ``seed``'s model and batches.

    Returns the mean loss of every step. ``watch(net)``, if given, makes a context manager (a
    `labs.threed.rounding.Rounding`) that is kept per step, with the loss's gradient ("grads") and
    the gradient Adam sees ("adam_grads": plus weight_decay * w)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = tiny.build(cfg, seed=seed)
        opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
        out = {"losses": [], "grads": [], "adam_grads": [], "watched": []}
        for step in range(steps):
            mode = watch(net) if watch else contextlib.nullcontext()
            total = 0.0
            with mode:
                for x, y in step_batches(cfg, step, dp, m, micro_batch, seed):
                    loss = net(x, y)
                    (loss / (dp * m)).backward()
                    total += loss.item()
            out["losses"].append(total / (dp * m))
            if watch:
                out["watched"].append(mode)
                out["grads"].append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
                out["adam_grads"].append({n: p.grad.detach() + weight_decay * p.detach()
                                          for n, p in net.named_parameters()})
            opt.step()
            opt.zero_grad()
        return out
    finally:
        torch.set_num_threads(threads)


def local_params(cfg, tp=1, pp=1, stage=0):
    """Parameters one rank of pipeline stage ``stage`` holds under tensor parallelism, from the shapes:
    per layer 12h^2/tp + 7h/tp (qkv, proj, fc, proj and their split biases) + 6h (two LayerNorms
    and the row-parallel layers' biases, replicated); stage 0 adds the token and position tables,
    the last stage the final LayerNorm and the head (no bias)."""
    h, layers = cfg.hidden, cfg.n_layer // pp
    n = layers * (12 * h * h // tp + 7 * h // tp + 6 * h)
    if stage == 0:
        n += cfg.vocab_size * h + cfg.seq_len * h
    if stage == pp - 1:
        n += 2 * h + cfg.vocab_size * h
    return n


def predict_bytes_per_group(cfg, dims, micro_batch, num_microbatches, seq, stage=None, elem=FP32):
    """Formula bytes each rank sends per training step, per group: {"dp", "tp", "pp", "cp": bytes}.

    ``dims``: the layout (`ParallelDims`). ``stage``: the pipeline stage of the rank (the groups'
    traffic differs by stage only in pp and dp); None: the busiest stage, per group. The formulas
    are in the module docstring, the ring factors `labs.formulas.costs`'; ring byte counts are exact
    when the group size divides each buffer (true for the tiny shapes, whose widths are even).
    """
    if stage is None:
        per_stage = [predict_bytes_per_group(cfg, dims, micro_batch, num_microbatches, seq, s, elem)
                     for s in range(dims.pp)]
        return {a: max(p[a] for p in per_stage) for a in AXES}
    b, m, h, tp, cp, pp = micro_batch, num_microbatches, cfg.hidden, dims.tp, dims.cp, dims.pp
    layers = cfg.n_layer // pp
    act = b * (seq // cp) * h * elem                            # one (b, s/cp, h) activation, bytes
    n = dims.size(("dp", "cp"))                                 # ranks that average gradients
    padded = -(-local_params(cfg, tp, pp, stage) // n) * n
    return {"tp": layers * m * 4 * costs.sent("all_reduce", act, tp),
            # K and V gathered forward, dK and dV reduce-scattered backward: four (s/cp)-row blocks
            "cp": layers * m * 4 * costs.sent("all_gather", act // tp * cp, cp),
            "pp": m * act * ((stage < pp - 1) + (stage > 0)),
            "dp": costs.sent("reduce_scatter", padded * elem, n) + costs.sent("all_gather", padded * elem, n)}


def crossing_bytes(cfg, dims, micro_batch, num_microbatches, seq, rank, ranks_per_node, elem=FP32):
    """Formula bytes rank ``rank`` sends to another node per step, per group, when the grid's ranks
    fill nodes of ``ranks_per_node`` in order. Chapter 2's ring sends everything to its right-hand
    neighbour, so a group's bytes cross when that neighbour is on another node; a pipeline stage sends
    its activations to the next stage and its gradients to the previous one."""
    c, node = dims.coords(rank), rank // ranks_per_node
    predicted = predict_bytes_per_group(cfg, dims, micro_batch, num_microbatches, seq, c["pp"], elem)
    away = lambda peer: peer is not None and peer // ranks_per_node != node
    out = {}
    for axis in AXES:
        ring = next(g for g in dims.groups(("dp", "cp") if axis == "dp" else axis) if rank in g)
        i = ring.index(rank)
        if axis == "pp":
            one = num_microbatches * micro_batch * (seq // dims.cp) * cfg.hidden * elem
            nxt, prev = (ring[i + 1] if i + 1 < len(ring) else None), (ring[i - 1] if i > 0 else None)
            out[axis] = one * (away(nxt) + away(prev))
        else:
            out[axis] = predicted[axis] if away(ring[(i + 1) % len(ring)]) else 0
    return out


def add_options(p, cli):
    """The command-line options both 3D commands take: the four degrees and the run's size."""
    for axis in AXES:
        p.add_argument(f"--{axis}", type=cli.positive_int, default=1, help=f"{axis} degree (default 1)")
    p.add_argument("--steps", type=cli.at_most(20, "steps of a tiny model"), default=STEPS)
    p.add_argument("--microbatches", type=cli.at_most(64, "micro-batches per step"), default=MICROBATCHES)
    p.add_argument("--micro-batch", type=cli.at_most(64, "sequences per micro-batch"), default=MICRO_BATCH)
