"""Chapter 5, pipeline parallel: schedules as data, one executor, and the bubble measured.

- `schedules`: GPipe, 1F1B, interleaved 1F1B and ZB-H1 as ordered actions per stage, bubble formulas.
- `executor`: runs any schedule with real sends and receives; gradients, bubble and peak memory.
- `schedule_figure`: a schedule's picture, drawn from the timeline the executor recorded.
- `split_backward`: backward split into B (input gradient) and W (weight gradient), for ZB-H1.
- `torch_pipelining`: the same pieces under ``torch.distributed.pipelining``'s schedules.
- `stage_balance`: the first and last stages' extra work (embedding, LM head, loss), a rebalanced split,
  and the book's one stage split (`stage_layers`, v chunks per rank).
- `pipeline_dp`: the pipeline with data parallelism, and what m >= p does to the global batch.
"""
