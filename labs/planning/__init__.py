"""Chapter 14, planning a real layout: a planner built from the earlier chapters' formulas, checked
against published runs. The layouts it plans are trained on real ranks in chapter 17 (`labs.threed`).

The planner itself is torch-free, in `labs.formulas.planning` (the site runs it in the reader's browser);
this package checks it and runs what it plans.

- `planner`: the planner as a command (``python -m labs.planning.planner``) and a widget.
- `eager_traffic`: the bytes an eager stack's elementwise ops move, counted on the tiny Llama block (the
  planner's `kernels.EAGER_TRAFFIC` is this count, recorded).
- `cases`: Megatron-LM's Table 1, Llama 3's Table 4, DeepSeek-V3 and the notes' questions, as planner cases.
- `published_tables`, `published_runs`: more published runs (A100, H100, H800; dense and MoE), as printed and
  as rows; `published_counts`: the FLOP count each source divides by, and the models its rows name.
- `checked`: the 112 published rows as planner jobs, the calibration (one eta per generation and precision),
the verdicts.
- `scorecard`: the checked set's figures, its rows by source, and each miss with the term that explains it.
- `trials`: inputs the model takes without fitting, varied in a fresh process: the dense GEMMs' shape term
  on the checked set, and sigma on NVLink at 0 for 70B's first layout.
- `ranking`: the ranking judged by measures that can fail: pairwise order within a source's layouts of a
job, the strict top three on tuned sources, and published out-of-memory layouts the planner must refuse.
- `notes`: the notes' three recipes, their interview questions and the stacks' layouts, through the planner.
- `meta_check`: one rank of a full-size layout built by PyTorch on the meta device (fake process group) holds
what the planner counts.
- `flop_count`: DeepSeek-V3's TFLOP/s per GPU derived from its GPU hours, its FLOPs per token term by term.
- `layout_figure`: a layout drawn on the GPUs, node by node: a replica a colour, a tp (or cp) group a box.
- `quiz`: the notes' readiness quiz, each question with a number answered by the planner or a chapter, and its
checker.
"""
