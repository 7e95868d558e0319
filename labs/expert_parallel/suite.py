"""Chapter 7: every multi-rank lab of the chapter, one after the other on the same ranks.

Starting ranks costs more than these tiny labs: the notebook and the tests spawn once and read each
lab's own result dict from the one run. Each entry is that lab's function, unchanged:
- ``layer`` / ``layer_cf1``: `moe_check.check_layer` without capacity and at capacity factor 1;
- ``grouped``: `dropless.check_grouped`, each rank's experts as one grouped GEMM;
- with 4 ranks also ``node`` (`node_dispatch.compare`), ``tail`` (`a2a_tail.sent_bytes`),
  ``ep_dp`` (`ep_dp.check`) and ``ep_tp`` (`ep_tp.check`);
- with ``zloss`` also ``zloss``: `moe_routing.zloss_runs` without and with c_z = 1e-2 on seed
  rank + 1, one process each, so the seeds run side by side after the collectives.

    python -m labs.expert_parallel.suite --world-size 4 --json
"""
from labs.expert_parallel import a2a_tail, dropless, ep_dp, ep_tp, moe, moe_check, moe_routing, node_dispatch
from labs.launcher import launch


def run(rank, world_size, tokens=32, hidden=16, experts=8, top_k=2, skews=(0.0, 0.5, 1.0, 1.5), batches=4,
        zloss=False):
    out = {"layer": moe_check.check_layer(rank, world_size, tokens, hidden, experts, top_k, None),
           "layer_cf1": moe_check.check_layer(rank, world_size, tokens, hidden, experts, top_k, 1.0),
           "grouped": dropless.check_grouped(rank, world_size, tokens=tokens)}
    if world_size == 4:   # the 2-node grid, ep x edp = 2 x 2 and tp x dp = 2 x 2 need 4 ranks
        out.update(node=node_dispatch.compare(rank, world_size),
                   tail=a2a_tail.sent_bytes(rank, world_size, skews, batches=batches),
                   ep_dp=ep_dp.check(rank, world_size), ep_tp=ep_tp.check(rank, world_size))
    if zloss:   # no collective: each rank trains its own seed
        out["zloss"] = moe_routing.zloss_runs((0.0, 1e-2), seed=rank + 1)
    return out


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Every multi-rank lab of chapter 7 on one set of ranks: errors against one process.",
                   world_size_default=4)
    args = cli.parse(p, argv)
    moe.check_ep(8, args.world_size)
    results = launch.launch(run, args.world_size, timeout=args.timeout)
    if results is None:
        return
    errors = {name: max(r[name]["max_abs_error"] for r in results)
              for name in ("layer", "layer_cf1", "grouped")}
    if len(results) == 4:
        errors["ep_tp"] = max(r["ep_tp"]["max_abs_error"] for r in results)
        errors["ep_dp"] = max(r["ep_dp"]["expert_error"] for r in results)
        errors["node"] = max(v[e] for r in results for v in r["node"].values()
                             for e in ("error_flat", "error_node"))
    result = {"max_abs_error": errors, "world_size": len(results)}
    cli.report(result, args,
               "max error against one process: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
