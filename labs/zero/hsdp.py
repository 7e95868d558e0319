"""Chapter 3: hybrid sharding (HSDP): FSDP inside a node, data parallelism across nodes.

PyTorch FSDP (Zhao et al. 2023, arXiv 2304.11277, section 3.2, "hybrid sharding") shards the
model over a sharding group of s ranks (a node, fast links) and replicates it over r = N/s such
groups (slow links between nodes). Per step each rank then all-gathers the weights (forward and
backward) and reduce-scatters the gradients inside its node, and only the reduce-scattered 1/s
slice of the gradient crosses nodes, in an all-reduce over the r replicas. With P_pad parameters
(each padded to a multiple of s), B bytes per element and a ring (formula bytes):

    inside the node, per rank:  3 (s-1)/s P_pad B      (all-gather fwd + bwd, reduce-scatter)
    across nodes, per rank:     2 (r-1)/r P_pad B / s  (all-reduce of the 1/s gradient slice)

Full sharding over all N ranks puts all 3 (N-1)/N P_pad B on a group that spans the nodes.

`GroupBytes` sees every c10d collective FSDP2 issues (a TorchDispatchMode sees ``c10d`` ops even
inside FSDP2), with the process group it ran on, the payload it was called with, and this rank's
wire bytes (`labs.measure.wire`: the barrier-fenced wchar delta; gloo on Linux only, else None + reason).

    run = launch.spawn(hsdp.hsdp_vs_full, 4, timeout=120)
"""
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.formulas import costs
from labs.measure import comm, wire
from labs.launcher import launch
from labs.memory_budget.compute import H100_BF16_DENSE
from labs import model as tiny
from labs.zero.distributed_optimizer import fsdp2_state_bytes

BF16 = 2
OPS = {"c10d._allgather_base_.default": "all_gather",
       "c10d._reduce_scatter_base_.default": "reduce_scatter",
       "c10d.allreduce_.default": "all_reduce"}


def _nbytes(t):
    return t.numel() * t.element_size()


class GroupBytes(TorchDispatchMode):
    """Every c10d collective run inside: (op, group label, group size, payload, formula bytes this
    rank sends in a ring, wire bytes this rank wrote). ``labels``: {group_name: label}."""

    def __init__(self, labels):
        super().__init__()
        self.labels, self.records = labels, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = OPS.get(str(func))
        if op is None:
            if func.namespace == "c10d" and "barrier" not in str(func):
                raise RuntimeError(f"GroupBytes does not know {func}: teach it the op's payload.")
            return func(*args, **kwargs)
        pg = dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject)))
        n, rank = pg.size(), pg.rank()
        if op == "all_gather":     # (output, input): each rank sends its shard to n-1 ranks
            payload = _nbytes(args[1])
            formula = costs.sent("all_gather", n * payload, n)
        elif op == "reduce_scatter":   # (output, input): the full buffer, n-1 of n slices leave
            payload = _nbytes(args[1])
            formula = costs.sent("reduce_scatter", n * _nbytes(args[0]), n)
        else:                          # ([tensors], ...): ring all-reduce, this rank's share
            t = args[0][0]
            payload = _nbytes(t)
            formula = comm.ring_allreduce_elements(t.numel(), n, rank) * t.element_size()
        reason = wire.unavailable(pg)
        if reason is None:
            dist.barrier(group=pg)   # the window: nothing else in flight on this group
            start = wire.wchar()
        out = func(*args, **kwargs)
        if reason is None:
            torch._C._distributed_c10d.Work.unbox(out[1]).wait()   # the data has gone
            wire_bytes = wire.wchar() - start
        self.records.append({"op": op, "group": self.labels[pg.group_name], "n": n, "payload": payload,
                             "formula_sent": formula, "wire_sent": None if reason else wire_bytes,
                             "element_size": (args[0][0] if op == "all_reduce" else args[1]).element_size()})
        return out

    def by_group(self):
        """{group: {op: {calls, payload, formula_sent, wire_sent}}}."""
        out = defaultdict(lambda: defaultdict(lambda: {"calls": 0, "payload": 0, "formula_sent": 0,
                                                       "wire_sent": 0}))
        for r in self.records:
            e = out[r["group"]][r["op"]]
            e["calls"] += 1
            for k in ("payload", "formula_sent"):
                e[k] += r[k]
            e["wire_sent"] = (None if r["wire_sent"] is None or e["wire_sent"] is None
                              else e["wire_sent"] + r["wire_sent"])
        return {g: dict(ops) for g, ops in out.items()}


def gloo_wire_model(record):
    """This rank's wire bytes for one record, from gloo's source (`labs.measure.wire`): all-gather is a ring
    of shards; reduce-scatter is a full ring all-reduce inside gloo, as is all-reduce."""
    n, es = record["n"], record["element_size"]
    if record["op"] == "all_gather":
        return wire.gloo_all_gather(n * record["payload"], n)
    return wire.gloo_allreduce_all_ranks(record["payload"], n, es) // n   # symmetric ring: 1/n each


def padded_params(net, s):
    """P_pad: every parameter padded on dim 0 to a multiple of s (FSDP2's Shard(0)), from shapes."""
    return sum(-(-p.shape[0] // s) * s * p[0].numel() for p in net.parameters())


def formula_bytes(p_pad, world_size, shard, elem=BF16):
    """Per rank per step: {"shard": bytes on the intra-node group, "replicate": bytes across nodes}."""
    r = world_size // shard
    return {"shard": 3 * (shard - 1) * p_pad * elem // shard,
            "replicate": 2 * (r - 1) * (p_pad // shard) * elem // r}


def shard_model(net, mesh, param_dtype=None):
    """FSDP2 on every block, then the root; every unit (root too) reshards after forward, so each
    step all-gathers every weight twice (forward, backward) and reduce-scatters it once."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype)   # reduce_dtype None: reduce in param_dtype
    for unit in list(net.blocks) + [net]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    return net


def _train(net, rank, world_size, steps, lr, mode=None):
    """Returns the losses, FSDP2's kept state after step 0, and step 0's averaged gradients (full)."""
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    losses, cfg, dev = [], tiny.GPTConfig(), launch.device()
    for step in range(steps):
        x, y = tiny.synthetic_batch(cfg, 2, seed=100 * step + rank, device=dev)
        with mode if (mode is not None and step == 0) else _Null():
            loss = net(x, y)
            loss.backward()
        if step == 0 and mode is None:   # Adam hides a gradient's scale: check the gradient itself
            grads = {k: p.grad.full_tensor().detach().cpu() for k, p in net.named_parameters()}
        opt.step()
        if step == 0:
            state = fsdp2_state_bytes(net, opt)   # before zero_grad: the gradients are still held
        opt.zero_grad()
        losses.append(loss.item())
    return losses, state, (grads if mode is None else None)


GRAD_TOL = 1e-5   # fp32 gradients summed in another order: ~1e-7 of the largest


def grad_error(got, want):
    """Largest |got - want| over every parameter's gradient, relative to the largest |want|: a
    replica that skipped the all-reduce, or summed it instead of averaging (2x), is off by a large
    fraction of 1; fp32 sums in another order, by about 1e-7."""
    scale = max(w.abs().max().item() for w in want.values())
    return max((got[k] - w).abs().max().item() for k, w in want.items()) / scale


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def reference(world_size, steps=2, lr=1e-3):
    """One process, fp32: every rank's batch as a micro-batch, gradients averaged, Adam.

    On one intra-op thread, as each spawned rank: a CPU kernel may split a reduction by thread, so
    the first step's losses are the ranks' bit for bit only at the ranks' thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(world_size, steps, lr)
    finally:
        torch.set_num_threads(threads)


def _reference(world_size, steps, lr):
    net = tiny.build()
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        losses.append([])
        for r in range(world_size):
            x, y = tiny.synthetic_batch(tiny.GPTConfig(), 2, seed=100 * step + r)
            loss = net(x, y)
            losses[-1].append(loss.item())
            (loss / world_size).backward()
        if step == 0:
            grads = {k: v.grad.detach().clone() for k, v in net.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {k: v.detach().clone() for k, v in net.named_parameters()}}


def hsdp_vs_full(rank, world_size, shard=2, steps=2, lr=1e-3):
    """HSDP (mesh (r, s), names ("replicate", "shard")) beside full sharding over all ranks.

    For each layout: one bf16 step under `GroupBytes` (records and per-group sums), FSDP2's kept
    state after that step (`fsdp2_state_bytes`), and ``steps`` fp32 steps (losses; on rank 0 the
    first step's averaged gradients and the final weights, full fp32). Rank 0 also returns the
    one-process reference and P_pad."""
    if world_size % shard or world_size == shard:
        raise ValueError(f"world_size {world_size} must be a multiple of shard {shard} with at least 2 "
                         "replicas; use e.g. 4 ranks with shard=2.")
    dev = launch.device().type
    hsdp = device_mesh(ParallelDims(dp=world_size, dp_replicate=world_size // shard), dev)[
        "dp_replicate", "dp_shard"]
    meshes = {"hsdp": hsdp, "full": device_mesh(ParallelDims(dp=world_size), dev)["dp"]}
    labels = {hsdp.get_group(f"dp_{d}").group_name: d for d in ("replicate", "shard")}
    labels[meshes["full"].get_group().group_name] = "all"
    out = {"ranks": {d: dist.get_process_group_ranks(hsdp.get_group(f"dp_{d}"))
                     for d in ("replicate", "shard")}}
    for name, mesh in meshes.items():
        mode = GroupBytes(labels)
        _, state, _ = _train(shard_model(tiny.build(device=launch.device()), mesh, torch.bfloat16),
                             rank, world_size, 1, lr, mode)
        net = shard_model(tiny.build(device=launch.device()), mesh)
        losses, _, grads = _train(net, rank, world_size, steps, lr)
        params = {k: v.full_tensor().detach().cpu() for k, v in net.named_parameters()}
        out[name] = {"records": mode.records, "by_group": mode.by_group(), "state": state,
                     "losses": losses, "params": params if rank == 0 else None,
                     "grads": grads if rank == 0 else None}
    if rank == 0:
        out["reference"] = reference(world_size, steps, lr)
        out["p_pad"] = {s: padded_params(tiny.build(), s) for s in (shard, world_size)}
        out["params"] = sum(p.numel() for p in tiny.build().parameters())
    return out


# ---- the inter-node bandwidth ZeRO-3 needs (chapter 1's compute model) -----------------------

# DGX H100: eight single-port ConnectX-7, up to 400 Gb/s InfiniBand each, one per GPU (NVIDIA
# DGX BasePOD reference architecture, "Core Components").
NIC_400G = 400e9 / 8   # bytes/s


def ring_crossings_per_node(n, node):
    """Ring neighbours on different nodes, per node, for a ring of ``n`` ranks placed node by node
    (rank r on node r // node, chapter 11's layout): each crossing carries one rank's per-ring bytes."""
    nodes = [r // node for r in range(n)]
    return sum(nodes[i] != nodes[(i + 1) % n] for i in range(n)) / max(1, -(-n // node))


def zero3_bandwidth(params, flops_per_token, tokens_per_rank, n, mfu=0.4, peak=H100_BF16_DENSE,
                    elem=BF16, nic=NIC_400G, node=8):
    """Formula: the inter-node bandwidth at which ZeRO-3's step communication takes as long as its
    compute. Per step a rank sends 3 (n-1)/n elem P bytes (all-gather fwd + bwd, reduce-scatter)
    and computes flops_per_token x T FLOPs at mfu x peak FLOP/s. With the ranks placed node by node
    a ring crosses each node's boundary once (`ring_crossings_per_node`): one rank's bytes leave a
    node per ring, however the library splits them over rings, spread over the node's ``node``
    rail NICs (chapter 11). Returns the bytes per rank per step, those leaving a node, seconds of
    compute, the node's bandwidth needed and its NICs' (``node_nic``), and the T from which they
    suffice (``tokens_at_nic``). With flops_per_token = 6P the model size cancels; only T counts."""
    if min(params, flops_per_token, tokens_per_rank, mfu, peak) <= 0 or n < 2:
        raise ValueError("params, flops_per_token, tokens_per_rank, mfu and peak must be "
                         "positive and n >= 2.")
    model = elem * params
    step_bytes = float(2 * costs.sent("all_gather", model, n) + costs.sent("reduce_scatter", model, n))
    node_bytes = step_bytes * ring_crossings_per_node(n, node)
    compute_s = flops_per_token * tokens_per_rank / (mfu * peak)
    need = node_bytes / compute_s
    return {"step_bytes": step_bytes, "node_bytes": node_bytes, "compute_s": compute_s,
            "bandwidth": need, "nic": nic, "node_nic": node * nic, "nic_ratio": need / (node * nic),
            "tokens_at_nic": need * tokens_per_rank / (node * nic)}


def worked_example(model="70B", seq=4096, micro_batch=2, n=64, mfu=0.4, node=8):
    """`zero3_bandwidth` for a published shape (`labs.memory_budget.budget.MODELS`), its FLOPs per token from
    chapter 1 (`labs.memory_budget.compute.flops_per_token`, attention included); beside it HSDP with a node
    of ``node`` GPUs as the shard group (Delta = 1, inside a node by chapter 11's rule) and the
    replicate group of stride ``node`` (one rank per node, each on its own rail): 2 (r-1)/r elem P /
    node bytes per rank cross nodes, ``node`` times that per node."""
    from labs.memory_budget.budget import MODELS
    from labs.memory_budget.compute import arch_matmul_params, flops_per_token
    arch = MODELS[model]
    per_token = flops_per_token(arch_matmul_params(arch), arch.layers, arch.hidden, seq)["total"]
    out = zero3_bandwidth(arch.params(), per_token, seq * micro_batch, n, mfu, node=node)
    r = n // node
    out["hsdp_cross_bytes"] = 2 * (r - 1) * BF16 * arch.params() / (r * node)
    out["hsdp_node_bytes"] = node * out["hsdp_cross_bytes"]
    out["hsdp_bandwidth"] = out["hsdp_node_bytes"] / out["compute_s"]
    return {**out, "model": model, "params": arch.params(), "flops_per_token": per_token, "seq": seq,
            "micro_batch": micro_batch, "n": n, "mfu": mfu, "node": node,
            "tokens_per_rank": seq * micro_batch}
