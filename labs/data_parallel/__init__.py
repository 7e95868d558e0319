"""Chapter 2, data parallel: all-reduce from point-to-point messages, and DDP built by hand.

- `hand_ring`: the ring reduce-scatter, all-gather and all-reduce (and the naive one) from counted
  messages, and ``hand_collectives()``, which runs the library's collectives as these rings.
- `ring_steps`: the ring all-reduce traced step by step as it ran (what arrives where), and its
  picture.
- `ring_allreduce`: ring and naive against the library: exact sum, bytes of each kind, time.
- `hand_ddp`: the hand DDP, buckets by dtype, overlap, ``no_sync``: a drop-in for torch's.
- `ddp`: the hand DDP, torch's DDP and one process end with the same parameters; overlap measured.
- `ddp_internals`: four things of torch's DDP a user meets (bucket order, gradient views, unused
  parameters, communication hooks).
- `bus_bandwidth`: algorithm and bus bandwidth the nccl-tests way, the factor measured on the wire.
- `loss_reduction`: how the loss is normalised under data parallelism and accumulation, against one process.
"""
