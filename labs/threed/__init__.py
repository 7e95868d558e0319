"""Chapter 17, training in 3D, equal to one process: the earlier chapters' pieces (ZeRO-1, Megatron's
tensor parallelism, 1F1B, all-gather context parallelism) composed on one rank grid, trained against
one process within a derived rounding bound, their bytes counted per group, and PyTorch's own 3D
stack beside them.

- `layout3d`: the degrees a 3D run (dp, tp, pp, cp) accepts, its data, one process's run, the bytes per group
predicted.
- `train3d`: the tiny GPT on dp x tp x pp and dp x cp x tp ranks from chapters 3-6's hand pieces, bytes
counted per group.
- `torch3d`: the same 3D layout with DeviceMesh, parallelize_module, fully_shard and pipelining, its bytes
audited.
- `rounding`: the first-order rounding bound of reordered sums, op by op, on one process's step.
- `drift`: the loss bound a correct layout stays within, and broken layouts that leave it.
- `seeds`: the planted bugs over the runs of many seeds, recorded once by hand (results/threed/seeds.json),
read by the notebook.
- `gradcheck`: the step-1 gradient beside one process's, per tensor: sees a gradient's scale, which Adam
hides.
- `problems`: the chapter's exercises, their answers from the lab's formulas and the usual mistakes.
"""
