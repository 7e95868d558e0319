"""Chapter 16, build it yourself: puzzles the reader solves in a notebook, graded on real ranks.

Each puzzle is one function the reader writes against a stub; its grader runs it on gloo ranks
through the book's launcher, compares the result with one process, counts its bytes against the
chapter's formula, measures memory where the piece is about memory, and says what differs.
The reference solution of each is the book's own lab from the chapter that teaches it.

- `grader`: carry a notebook function's source to the ranks, the deadline, the ``pass``/``not yet`` report.
- `ring`: puzzle 1, a ring all-reduce from send and recv (chapter 2).
- `ddp`: puzzle 2, a DDP gradient hook with buckets and no_sync (chapter 2).
- `zero1`: puzzle 3, a ZeRO-1 sharded optimizer step with Adam (chapter 3).
- `fsdp`: puzzle 4, an FSDP unit: gather before forward, free after it, reduce-scatter (chapter 3).
- `mlp`: puzzle 5, Megatron's MLP split with its operators f and g (chapter 4).
- `ring_attn`: puzzle 7, ring attention's K/V rotation, online softmax and causal mask (chapter 6).
- `dispatch`: puzzle 8, MoE dispatch and combine with two all-to-alls (chapter 7).
- `schedule`: puzzle 6, the 1F1B schedule as data, run by chapter 5's executor (chapter 5).
"""
