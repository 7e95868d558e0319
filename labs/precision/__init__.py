"""Chapter 8, mixed precision: FP16, BF16 and FP8, and what each costs in range and error.

- `loss_scaling`: the formats read from torch.finfo, FP16 underflow, dynamic loss scaling beside GradScaler.
- `fp8`: FP8 scaling granularity (tensor, row, 1x128 / 128x128 blocks), limited-precision accumulation.
- `kernels`: which ``torch._scaled_mm`` recipes this build really runs, each tried, against the emulation.
- `fp8_wire`: FP8 through gloo as uint8, the library's wire bytes beside BF16's.
- `scaling`: MXFP8 (1x32, E8M0) beside 1x128 tiles; delayed (amax history) beside current scaling.
- `master_weights`: BF16 weights without an FP32 master (lost updates, stochastic rounding, Kahan);
  FP32 accumulation of 16-bit products.
- `figures`: the chapter's pictures (bit layouts and ranges, underflow, the loss-scale trace, FP8
  granularity over draws, the scaled FP8 matrix product end to end), drawn from what the lab read or ran.
- `experiment`: the chapter's command line, one experiment per run.
- `__main__.py`: ``python -m labs.precision --experiment NAME``, every experiment of the chapter.
The recipes and their Adam, which chapter 1 already counts, are `labs.memory_budget.recipes`.
"""
