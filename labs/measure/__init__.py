"""Measurement, shared by every chapter: three kinds of bytes never mixed, memory, FLOPs, numbers.

- `comm`: counted collectives and point-to-point calls: counted messages, formula bytes and the
  library's wire bytes kept apart, and the payload each call was made with.
- `wire`: the library's wire bytes, the rise of ``wchar`` in /proc/self/io around a gloo call.
- `memory`: bytes a rank holds (storage accounting) and its peak during a step.
- `memory_snapshot`: the live storages over time, per operator, in the snapshot format of PyTorch's
  memory viewer (``_dump_snapshot``'s dict); its peak is `memory`'s peak to the byte.
- `timing`: the host clock read after the GPU's queued work is done, for every timed region.
- `flops`: FLOPs counted by ``FlopCounterMode``, the CPU's SDPA kernel included.
- `report`: how a notebook states a float to the precision its assertion guarantees; glue.
- `intervals`: a timing claim as a paired ratio with its interval and range; a winner only where
  the interval excludes 1 and no more ranks ran than cores.
- `exercises`: the automatic checker behind every chapter's exercises.
- `widgets`: the book's calculators (`labs.formulas.forms`) as ipywidgets in JupyterLab, the same fields
  and answers as the site's forms.
The formula bytes (the ring factors) are in the torch-free core, `labs.formulas.costs`.
"""
