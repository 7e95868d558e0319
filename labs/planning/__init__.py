"""Chapter 14, planning a real layout: a planner built from the earlier chapters' formulas, checked
against published runs.

- `shapes`: a model as its weight matrices and how tensor parallelism splits each; a cluster as its links and peak.
- `memory`: what one rank of a layout holds, six terms, each from the chapter that derived it.
- `traffic`: the formula bytes each parallel group sends per rank per step, and the link tier it uses.
- `timing`: the estimated step time (compute at a calibrated efficiency, exposed bytes, bubble) and the papers' FLOPs.
- `planner`: every layout of a job, the rule or memory term that rejects it, the rest ranked by step time.
- `cases`: Megatron-LM's Table 1, Llama 3's Table 4, DeepSeek-V3 and the notes' questions, and the one calibration.
- `meta_check`: one rank of a full-size layout built by PyTorch on the meta device (fake process group) holds what the planner counts.
- `quiz`: the notes' readiness quiz, each question with a number answered by the planner or a chapter, and its checker.
"""
