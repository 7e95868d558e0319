"""Chapter 14, planning a real layout: the layouts composed, trained and held to one process.

- `layout3d`: the degrees a 3D/4D run accepts, its data, one process's run, the bytes per group predicted.
- `train3d`: the tiny GPT on dp x tp x pp (x cp) ranks from chapters 3-6's hand pieces, bytes counted per group.
- `torch3d`: the same 3D layout with DeviceMesh, parallelize_module, fully_shard and pipelining, its bytes audited.
- `rounding`: the first-order rounding bound of reordered sums, op by op, on one process's step.
- `drift`: the loss bound a correct layout stays within, and broken layouts that leave it.
"""
