"""Chapter 14's planner, torch-free: every layout of a job, the rule or memory term that refuses it, the
rest ranked by an estimated step time, from the earlier chapters' formulas. Chapter 14's lab
(`labs.planning`) checks it against published runs and a meta-device rank.

- `shapes`: the models the planner is checked on (chapter 1's `ModelShape`) and a cluster as its links, peaks
and memory.
- `software`: what a training stack offers and which collectives it overlaps, each switch from its source.
- `grid`: the planner's candidate, a layout and its settings as a record of small integers (plain Python).
- `memory`: a layout (`Plan`: a `ParallelDims` and its settings) and what one rank holds, six terms.
- `traffic`: the collectives each group runs per micro-batch and per step, and their formula bytes.
- `kernels`: one layer's compute on a rank, GEMM by GEMM on a roofline, attention and the memory-bound ops.
- `offload`: the optimizer in host memory (ZeRO-Offload): GPU bytes freed, host bytes, PCIe and CPU time.
- `timing`: the estimated step time, phase by phase, with what each stack overlaps, and the papers' FLOPs.
- `search`: every setting of each layout priced on three stages; the fastest that fits, or what overflows.
- `calibrated`: the one fitted constant per GPU generation and precision, recorded from chapter 14's fit.
- `planner`: every layout of a job, the rule or memory term that rejects it, the rest ranked by step time.
"""
