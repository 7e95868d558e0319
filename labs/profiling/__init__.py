"""Chapter 15, profiling: where a step's time goes, read from torch.profiler traces of every rank.

- `trace`: one Chrome/Perfetto trace per rank (`Recorder`), read back (`load`); what gloo records.
- `intervals`: union, intersection and difference of time intervals (nested events counted once).
- `analysis`: per rank and step, compute, communication in flight and exposed, peer wait, input,
  idle; the communication per operation; the memory record; whether the trace covers the step.
- `targets`: the book's training labs (DDP, FSDP, FSDP2, TP, 1F1B, GPipe, 3D) as one step each.
- `lab`: a training lab (or several, in one job) under the profiler on every rank, traces analysed together.
- `__main__`: ``python -m labs.profiling --lab ddp --world-size 2 --json``, `lab`'s command.
- `figures`: per-rank timelines (compute, exposed, waiting, in flight) drawn from the analysis.
- `timing`: a ratio of interleaved repeats with a distribution-free interval; a winner only outside 1.
- `overlap`: two variants in alternating steps under one profiler: DDP's buckets, FSDP2's prefetch.
- `collective_matmul`: the all-gather matmul as ring steps under the matmuls, equal to the plain layer;
  its control, the same ring with each transfer waited for first.
- `moe_overlap`: two micro-batches' all-to-alls hidden under each other's compute, equal outputs.
- `input_pipeline`: a slow data loader, in the loop and in prefetching workers: the input stall.
- `hta_check`: Holistic Trace Analysis on the same traces: what it reads on the CPU, its GPU breakdowns.
- `quiz`: the chapter's exercises, each answer computed by the chapter's code, and their checker.
- `opt_exercise`: OPT-1.3B's shapes under DDP, FSDP2 and FSDP2 + checkpointing: memory, communication.
- `recorded`: the traces the chapter links, recorded on purpose by one command (the notebook only reads them).
- `practice`: torch.profiler as a training loop uses it (schedule, on_trace_ready, prof.step,
  record_function, key_averages, with_stack) on every rank, and the ranks' traces merged, pid per rank.
- `planner_check`: chapter 14's time and traffic models calibrated here (FLOP/s, alpha, beta), predicted
  beside traced.
"""
