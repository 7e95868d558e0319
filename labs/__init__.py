"""Labs for *Distributed Training, Measured*: the book's table of contents in code.

One package per chapter, named after its technique, over three shared packages that every chapter
uses; imports point one way (a chapter uses the shared packages and earlier chapters, never the
reverse; `tests/test_layout.py` checks it):

    launcher/         start N ranks from a notebook, a test or torchrun; the command-line contract
    measure/          counted collectives, wire bytes, formula bytes (the ring factors), memory, FLOPs
    formulas/         the formulas without torch or numpy: the labs check them, the site's forms run them
    model.py          the tiny GPT (and Llama block) every chapter parallelises from outside
    dims.py           the degrees of a layout (ParallelDims), checked once: rank grid, groups, mesh, tiers
    groups.py         the process groups of a running job, made from a ParallelDims
    memory_budget/    chapter 1          data_parallel/    chapter 2          zero/            chapter 3
    tensor_parallel/  chapter 4          pipeline/         chapter 5          context_parallel/ chapter 6
    expert_parallel/  chapter 7          precision/        chapter 8          recompute/       chapter 9
    collectives/      chapter 10         hardware/         chapter 11         checkpointing/   chapter 12
    failures/         chapter 13         planning/         chapter 14         profiling/       chapter 15
    puzzles/          chapter 16 (build it yourself: the reader's code graded on real ranks)
    threed/           chapter 17 (training in 3D: the chapters' pieces composed, equal to one process)
    gpu/              the GPU recording command, on top of them all

Every lab runs multi-process through `labs.launcher.launch` and returns a plain result dict that
its chapter's notebook asserts on.
"""
