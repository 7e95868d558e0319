"""Chapter 5, pipeline parallel: one executor for the schedules, and the bubble measured.

The schedules as data and their bubble formulas are torch-free: `labs.formulas.schedules`.

- `problems`: the chapter's worked problems, answered by the formulas, and their checker.
- `executor`: runs any schedule with real sends and receives; gradients, bubble and peak memory.
- `wall_clock`: the wall-clock bubble, checked against a planted bug that serialises the stages.
- `schedule_figure`: a schedule's picture, drawn from the timeline the executor recorded.
- `split_backward`: backward split into B (input gradient) and W (weight gradient), for ZB-H1.
- `torch_pipelining`: the same pieces under ``torch.distributed.pipelining``'s schedules.
- `v_schedules`: the library's V-shaped ZB-V and DualPipeV, simulated on its own order beside the executor's.
- `stage_balance`: the first and last stages' extra work (embedding, LM head, loss), a rebalanced split,
  and the book's one stage split (`stage_layers`, v chunks per rank).
- `pipeline_dp`: the pipeline with data parallelism, and what m >= p does to the global batch.
"""
