"""Chapter 15, profiling: where a step's time goes, read from torch.profiler traces of every rank.

- `trace`: one Chrome/Perfetto trace per rank (`Recorder`), read back (`load`); what gloo records.
- `intervals`: union, intersection and difference of time intervals (nested events counted once).
- `analysis`: per rank and step, compute, communication in flight and exposed, peer wait, idle.
- `targets`: the book's training labs (DDP, FSDP, FSDP2, TP, 1F1B, GPipe, 3D) as one step each.
- `lab`: a training lab under the profiler on every rank, its traces analysed together.
- `__main__`: ``python -m labs.profiling --lab ddp --world-size 2 --json``, `lab`'s command.
"""
