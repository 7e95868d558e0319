"""Chapter 7, expert parallel: a mixture of experts spread over ranks, tokens moved by all-to-all.

- `router`: top-k routing with capacity, DeepSeek-V3's bias and node limit, and each choice's margin from a tie.
- `moe`: the layer and expert parallelism against one process, with the all-to-all bytes counted.
- `moe_routing`: what routing decides: dropped tokens, expert balance, bytes across nodes.
"""
