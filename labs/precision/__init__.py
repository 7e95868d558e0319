"""Chapter 8, mixed precision: FP16, BF16 and FP8, and what each costs in range and error.

- `loss_scaling`: FP16 underflow and dynamic loss scaling, measured.
- `fp8`: FP8 scaling granularity, limited-precision accumulation, FP8 bytes on the wire.
- `experiment`: the chapter's command line, one experiment per run.
- `__main__.py`: ``python -m labs.precision --experiment NAME``, every experiment of the chapter.
The recipes and their Adam, which chapter 1 already counts, are `labs.memory_budget.recipes`.
"""
