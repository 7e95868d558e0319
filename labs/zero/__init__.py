"""Chapter 3, ZeRO and FSDP: sharding the model state, and what each stage holds, peaks at and sends.

- `sharded_optimizer`: ZeRO stages 0-2, a sharded optimizer around any ``torch.optim`` class.
- `fsdp`: ZeRO stage 3, a hand FSDP that wraps any module by units, with FSDP2 beside it.
- `answers`: the per-rank formulas of each stage, and the chapter's exercises with their checker.
- `timeline`: ZeRO-3's gather, compute and free timeline, recorded and laid out with prefetch.
- `held`: what a rank holds between steps, by category and by every storage reachable from it.
- `stages`: the lab: every stage on the tiny GPT, bytes held, peak and sent against the formulas.
- `adam_drift`: how far two Adam runs can drift apart, the bound "equal to one process" is held to.
- `unseen_model`: a model none of the hand pieces was written for (frozen, tied, unused parameters).
- `hsdp`: hybrid sharding, FSDP inside a node and data parallel across: the bytes inside and across nodes.
- `distributed_optimizer`: what each ZeRO-style recipe keeps per parameter, beside FSDP2's state.
"""
