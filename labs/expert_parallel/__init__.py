"""Chapter 7, expert parallel: a mixture of experts spread over ranks, tokens moved by all-to-all.

- `router`: top-k routing with capacity, DeepSeek-V3's bias and node limit, each choice's margin from a tie,
the z-loss.
- `moe`: the layer and its expert-parallel twin, dispatch and combine as two all-to-alls, payloads logged.
- `moe_check`: the twin equals one process: outputs, gradients, the rows that arrive and the bytes per
destination.
- `moe_routing`: what routing decides: dropped tokens, expert balance (Switch loss, V3's bias and sequence
loss), the z-loss.
- `node_dispatch`: DeepSeek-V3's once-per-node dispatch built and counted per link tier against the flat one.
- `a2a_tail`: the all-to-all's slowest rank under skewed routing, received bytes counted against the
derivation.
- `dropless`: MegaBlocks' dropless MoE as a grouped GEMM beside capacity buffers, equal to one process, FLOPs
counted.
- `ep_dp`: under expert + data parallelism, which group reduces the router's and the experts' gradients,
counted.
- `ep_tp`: attention by TP + SP and the MoE by EP over the same ranks (MoE parallel folding), equal to one
process.
- `trip_figure`: a token's trip (route, dispatch, experts, combine) drawn on 2 ranks, its rows computed; one
token's node-deduplicating dispatch drawn beside the flat one.
- `suite`: every multi-rank lab above on one set of ranks, so the notebook starts its ranks once.
"""
