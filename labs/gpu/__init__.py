"""The GPU recording command, on top of every chapter: the figures the book quotes for a GPU.

- `record`: the command: sizes, provenance, every section, results/gpu/<device>.json.
- `__main__.py`: ``python -m labs.gpu [--dry-run]``.
- `figures`: a figure (value, unit, kind, formula) or a skipped/refused reason, never a made-up number.
- `memory`: chapter 1 on a GPU: bytes a layer keeps for backward, an Adam step's bytes per parameter.
- `speed`: bf16 and FP8 matmul speed, MFU (chapter 1), recomputation's cost (chapter 9), copy bandwidth.
- `dcp`: chapter 12 on a GPU: the pause of a synchronous and an asynchronous checkpoint.
- `smoke`: the chapters' labs at world size 1 on the launcher's own choice (NCCL on a GPU box).
- `recorded`: what results/gpu/*.json holds, as the lines notebooks 1 to 3 print beside the CPU's.
"""
