"""Chapter 9, recomputation and gradient accumulation: memory kept against FLOPs spent.

- `policies`: none, full, selective and every-k recomputation on a stack of blocks: bytes kept,
  FLOPs counted, gradients equal; the GPT-3 overheads, the lab's count beside Korthikanti et al.'s.
- `accumulation`: micro-batches against the full batch; DDP's no_sync counted; FSDP2's and the hand
  FSDP's gradient sync switch (bytes sent, bytes held, peak); clipping and the loss scale under accumulation.
- `offload`: saved activations copied to a simulated host (save_on_cpu's hooks): bytes kept, peak, bytes
moved.
- `pipeline_memory`: 1F1B on chapter 5's executor with and without recomputation: held = in flight x policy.
- `compiled`: torch.compile's min-cut partitioner per activation memory budget: bytes kept, backward
  FLOPs (budget 0 = one more forward), gradients against the uncompiled stack.
- `clip_norm`: gradient clipping across shards: the global norm under FSDP + TP and PP + TP, each
  parameter counted once (Megatron's rule by hand, torch's and torchtitan's with DTensors), equal to
  one process; counting TP-replicated parameters on every tp rank, or a stage's own norm, is caught.
"""
