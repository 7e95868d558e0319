"""Chapter 9, recomputation and gradient accumulation: memory kept against FLOPs spent.

- `policies`: none, full, selective and every-k recomputation on a stack of blocks: bytes kept,
  FLOPs counted, gradients equal; accumulation through chapter 2's DDP and loss normalisation.
"""
