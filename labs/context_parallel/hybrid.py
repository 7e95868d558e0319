"""Chapter 6: hybrid context parallelism, Ulysses inside a node and the ring across nodes.

USP (Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach for Long Context Generative
AI", arXiv 2405.07719; their code, yunchang's `LongContextAttention`) arranges the cp ranks as R
ring groups of u Ulysses ranks: an all-to-all inside each Ulysses group turns its sequence split
into a head split over u ranks, ring attention runs across the R groups on blocks of u T/cp tokens
and a/u heads, and a second all-to-all turns the output back. Megatron-LM's hierarchical context
parallelism is the same arrangement (``cp_comm_type="a2a+p2p"``, ``hierarchical_context_parallel_sizes
= [u, R]``: the first level's u ranks run the all-to-all, the second's R the ring, and every u
adjacent GPUs form a first-level group). With u the GPUs of a node, the all-to-all stays on the
node's links and only the ring crosses the network.

Layout (`hybrid_layout`): rank = node * u + m. At the ring level node n holds the zig-zag chunks n
and 2R-1-n of 2R (or the contiguous chunk n), each cut into u pieces; member m holds piece m of
each. After the all-to-all every member of node n holds the node's tokens for a/u heads.

Bytes one rank sends, per link tier (q, kappa: its Q and K blocks, T/cp tokens; r = `ulysses.kv_repeats`):
    inside the node (the all-to-alls, u ranks): (u-1)/u (2q + 2 r kappa) forward, the same backward
    across nodes (the ring, R nodes): its K block has u times the tokens and 1/u of the heads,
    r kappa bytes: 2(R-1) r kappa forward, (4R-2) r kappa backward.
Each message is counted under its destination (`comm.Tally.sent_to`), so the tiers are counted.

    python -m labs.context_parallel.hybrid --world-size 4 --ulysses 2 --json
"""
import torch.distributed as dist

from labs.dims import ParallelDims
from labs.groups import device_mesh
from labs.measure import comm
from labs.launcher import launch
from labs.context_parallel import methods, ring_attention as ra, ulysses


def check_grid(world_size, u, seq_len, order, heads, kv_heads):
    """Refuse a grid that cannot be made, in one sentence, before any rank starts."""
    if u < 1 or world_size % u:
        raise ValueError(f"the Ulysses group of {u} ranks must divide the {world_size} ranks; "
                         f"choose a divisor of {world_size}.")
    pieces = (world_size // u) * (2 if order == "zigzag" else 1) * u
    if seq_len % pieces:
        raise ValueError(f"the hybrid {order} split cuts the sequence into {pieces} pieces: seq_len "
                         f"= {seq_len} is not divisible by {pieces}; choose a multiple of {pieces}.")
    if heads % kv_heads:
        raise ValueError(f"GQA needs the KV heads to divide the query heads: {kv_heads} does not "
                         f"divide {heads}.")
    ulysses.check_heads(heads, kv_heads, u)


def hybrid_layout(world_size, u, seq_len, order="zigzag"):
    """Every rank's chunks: node n's ring-level chunks, each cut into u pieces, piece m to member m."""
    nodes = methods.layout(world_size // u, seq_len, order)
    return [[(s + m * (n // u), n // u) for s, n in nodes[node]] for node in range(world_size // u)
            for m in range(u)]


def groups(u):
    """(Ulysses group, ring group) of this rank: the job's context-parallel mesh dimension
    (`labs.groups.device_mesh`) unflattened into (R, u): the Ulysses group is u consecutive ranks (a node),
    the ring group the ranks at the same place in every node."""
    cp = device_mesh(ParallelDims(cp=dist.get_world_size()), launch.device().type)["cp"]
    mesh = cp._unflatten(0, (dist.get_world_size() // u, u), ("ring", "ulysses"))
    return mesh.get_group("ulysses"), mesh.get_group("ring")


def hybrid_attention(q, k, v, table, causal, ulysses_group, ring_group, work=None, block=None):
    """This rank's attention output (B, a, T/cp, d): all-to-all in the node, the ring across nodes."""
    u, n_nodes = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    ulysses.check_heads(q.shape[1], k.shape[1], u)
    k, v = ulysses.repeat_kv(k, v, u)
    # (B, a/u, u T/cp, d), (B, k'/u, u T/cp, d)
    qh, kh, vh = ulysses.seq_to_heads([q, k, v], ulysses_group)
    ring_table = [[c for m in range(u) for c in table[node * u + m]] for node in range(n_nodes)]
    out = ra.ring_attention(qh, kh, vh, ring_table, causal, group=ring_group, work=work, block=block)
    return ulysses.heads_to_seq(out, ulysses_group)                  # (B, a, T/cp, d)


def tier_formula(q_bytes, kv_bytes, world_size, u, kv_heads):
    """Derived bytes one rank sends inside its node and across nodes, forward and backward."""
    r, n_nodes = ulysses.kv_repeats(kv_heads, u), world_size // u
    intra = (u - 1) * (2 * q_bytes + 2 * r * kv_bytes) // u
    return {"forward": {"intra": intra, "inter": 2 * (n_nodes - 1) * r * kv_bytes},
            "backward": {"intra": intra, "inter": (4 * n_nodes - 2) * r * kv_bytes}}


def _run(method, mine, table, causal, u, groups_, work, block):
    if method == "hybrid":
        return hybrid_attention(*mine, table, causal, *groups_, work=work, block=block)
    if method == "ring":
        return ra.ring_attention(*mine, table, causal, work=work, block=block)
    return ulysses.ulysses_attention(*mine, table, causal, work=work, block=block)


def check(rank, world_size, u=2, seq_len=24, heads=8, kv_heads=8, head_dim=8, batch=2, causal=True,
          order="zigzag", methods_run=("hybrid", "ring", "ulysses"), block=None):
    """The hybrid (and, on the same ranks, plain ring and plain Ulysses) against one process's attention.

    Per method: ``errors`` (output, dq, dk, dv), ``bytes_sent`` (counted, `labs.measure.comm`),
    ``tiers`` (the same messages by destination: inside this rank's node of u ranks, or across),
    ``work`` (score entries computed) and, for the hybrid, ``tier_formula``.
    """
    check_grid(world_size, u, seq_len, order, heads, kv_heads)
    q, k, v, do = methods.inputs(batch, heads, kv_heads, seq_len, head_dim, launch.device())
    ref, leaves = methods.reference(q, k, v, causal)
    (ref * do).sum().backward()
    groups_ = groups(u)
    node = rank // u
    out = {}
    for method in methods_run:
        table = hybrid_layout(world_size, u, seq_len, order) if method == "hybrid" else \
            methods.layout(world_size, seq_len, order)
        rows = methods.rows_of(table[rank]).to(q.device)
        mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
        work = dict.fromkeys(("tiles_full", "tiles_masked", "score_entries", "unmasked_entries"), 0)
        sent, tiers = {}, {}
        for phase in ("forward", "backward"):
            with comm.counting() as tally:
                if phase == "forward":
                    o = _run(method, mine, table, causal, u, groups_, work, block)
                else:
                    (o * do[:, :, rows]).sum().backward()
            sent[phase] = tally.bytes_sent
            to = tally.sent_to
            tiers[phase] = {"intra": sum(b for dst, b in to.items() if dst // u == node),
                            "inter": sum(b for dst, b in to.items() if dst // u != node)}
        errors = {"output": (o - ref[:, :, rows]).abs().max().item()}
        errors.update({g: (t.grad - r.grad[:, :, rows]).abs().max().item()
                       for g, t, r in zip(("dq", "dk", "dv"), mine, leaves)})
        nbytes = [t.numel() * t.element_size() for t in mine]
        out[method] = {"errors": errors, "bytes_sent": sent, "tiers": tiers, "work": work,
                       "rows": rows.tolist(),
                       "tier_formula": tier_formula(nbytes[0], nbytes[1], world_size, u, kv_heads),
                       "shapes": {"q": list(mine[0].shape), "kv": list(mine[1].shape)}}
    return out


def check_kv(rank, world_size, u=2, seq_len=24, heads=8, kv_heads=(8, 1), **kw):
    """`check` at several KV-head counts in one job (one start of the ranks): {kv_heads: result}."""
    return {kv: check(rank, world_size, u, seq_len, heads, kv, **kw) for kv in kv_heads}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Hybrid context parallelism: Ulysses inside each node of u ranks, the ring across nodes, "
                   "against one process, with the bytes of each link tier counted.")
    p.add_argument("--ulysses", type=cli.positive_int, default=2,
                   help="ranks per node, the Ulysses group (u)")
    p.add_argument("--seq-len", type=cli.at_most(1 << 12, "tokens"), default=24)
    p.add_argument("--heads", type=cli.at_most(256, "query heads"), default=8)
    p.add_argument("--kv-heads", type=cli.positive_int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--order", choices=methods.ORDERS, default="zigzag")
    args = cli.parse(p, argv)
    kv = args.kv_heads or args.heads
    check_grid(args.world_size, args.ulysses, args.seq_len, args.order, args.heads, kv)
    results = launch.launch(check, args.world_size, args.ulysses, args.seq_len, args.heads, kv,
                            timeout=args.timeout)
    if results is None:
        return
    r = {m: {"max_abs_error": max(max(x[m]["errors"].values()) for x in results),
             "tiers": [x[m]["tiers"] for x in results]} for m in results[0]}
    r.update(world_size=len(results), ulysses_ranks_per_node=args.ulysses,
             tier_formula=results[0]["hybrid"]["tier_formula"])
    cli.report(r, args, f"hybrid CP on {len(results) // args.ulysses} nodes x {args.ulysses}: max error "
               f"{r['hybrid']['max_abs_error']:.1e}; bytes per rank inside / across nodes, forward: "
               + "; ".join(f"{m} {r[m]['tiers'][0]['forward']}" for m in results[0]))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
