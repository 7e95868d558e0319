"""The book's formulas, free of torch and numpy: what the labs check and the site's calculators run.

Everything here is plain Python (the standard library only), so the same code answers in a
notebook, on the command line, in the tests and, through Pyodide, in a reader's browser on the
static site. The torch side stays in the chapters' packages: FLOP counting, dispatch-mode traffic,
the meta device, and everything that runs ranks; they import these formulas and check them.
`tests/test_formulas.py` fails if any module here imports torch or numpy.

- `shape` (chapter 1): a model as its published shapes and weight matrices, the one model type every
  chapter uses; `hf_config`: any model's shape from its Hugging Face config.json.
- `activations` (chapter 1): what a block, and the logits above the blocks, keep for backward.
- `memory` (chapter 1): bytes per parameter by recipe and ZeRO stage, and whether a configuration fits.
- `flops` (chapter 1): parameters by weight, FLOPs per token, MFU and HFU, Llama 3's Table 4.
- `zero` (chapter 3): bytes per parameter per rank of ZeRO-3, Megatron's distributed optimizer and FSDP2.
- `tensor_parallel` (chapter 4): how query and KV heads sit on tp ranks.
- `costs` (chapters 2 to 14): formula bytes one rank sends per collective, the one table (the ring factors).
- `collectives` (chapters 10 and 11): NCCL's cost model's constants and the links' bandwidths.
- `links` (chapters 2, 3, 4, 10, 11 and 14): one collective's time on its group, NCCL's alpha per
  link tier plus the bytes over the link; `ring_bandwidth`, a ring's W inside a node or across nodes.
- `schedules` (chapter 5): GPipe, 1F1B, interleaved 1F1B and ZB-H1 as ordered actions per stage, their
  bubble formulas and peak in-flight micro-batches.
- `stages` (chapter 5): the stage split, which layers each pipeline rank holds (`stage_layers`).
- `planning` (chapter 14): the planner, a package of its own (its `__init__` lists its modules).
- `forms`: the calculators, by name: their fields and answers (the site's forms and JupyterLab's
  widgets); `fields`: parsing a form's strings, one sentence for bad input, the answer as text, HTML
  and an SVG bar; one module per calculator: `form_memory` (chapter 1), `form_collective` (chapters 2 and
  10), `form_bubble` (chapter 5), `form_planner` (chapter 14).
"""
