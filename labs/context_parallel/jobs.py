"""Chapter 6: the context-parallel labs in one job, for the notebook.

Starting cp ranks costs more on a CPU than the small runs themselves, so the notebook starts them
once and runs every context-parallel lab of the chapter in that job, each exactly as it runs alone:
`methods.check_many` (the three methods against one process, the KV-head sweep), `ring_steps.timed`
(the ring's compute and wait per step; first, so that nothing else shares the cores meanwhile),
`hybrid.check_kv` (Ulysses in a node, the ring across) and `traps.loss_trap` (the loss over a
sharded sequence). Each lab module keeps its own command line.
"""
from labs.context_parallel import hybrid, methods, ring_steps, traps


def lab(rank, world_size, cases, steps=None, hybrid_kw=None, trap_tokens=()):
    """{"methods": check_many(cases), "steps": timed(**steps), "hybrid": check_kv(**hybrid_kw),
    "traps": {valid_tokens: loss_trap}}, the parts whose arguments are given."""
    out = {}
    if steps is not None:
        out["steps"] = ring_steps.timed(rank, world_size, **steps)
    out["methods"] = methods.check_many(rank, world_size, cases)
    if hybrid_kw is not None:
        out["hybrid"] = hybrid.check_kv(rank, world_size, **hybrid_kw)
    out["traps"] = {n: traps.loss_trap(rank, world_size, n) for n in trap_tokens}
    return out
