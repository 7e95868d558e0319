"""Chapter 10, the collectives toolkit: every collective from point-to-point messages, counted.

- `algorithms`: tree, ring, recursive doubling and halving, Rabenseifner, pairwise, one function each.
- `recursive`: recursive doubling and halving on any number of ranks (the fold), and `Rounds`.
- `toolkit`: each algorithm against the library and its counted rounds and bytes; the command line.
- `alpha_beta`: the alpha-beta model: each all-reduce's rounds and bytes, the crossover, the latency and
  the line fitted by relative error (`model`, `fit_line`), M*'s bootstrap, and an nccl-tests-style table.
- `crossover`: recursive doubling against the ring, timed in interleaved pairs around the predicted
  crossover; each size's ratio with its interval, a winner only where it excludes 1.
- `hierarchical`: a two-level all-reduce on a simulated grid of nodes, bytes counted per link tier.
- `gloo_collectives`: beside each hand collective, what gloo's own puts on the wire.
- `pictures`: each algorithm's messages as a picture, from the rounds a lab run logged.
- `nccl_model`: NCCL's algorithms and protocols as its tuning model costs them (read, not measured).
"""
