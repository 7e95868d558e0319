"""Chapter 13, failures at scale: faults injected into real processes, detected and recovered from.

- `fault_training`: the tiny data-parallel job the faults are injected into.
- `scenarios`: a hang named by the heartbeat, a killed rank restarted from its checkpoint, and the
  command line for all five scenarios.
- `silent_faults`: the faults that raise no error: a flipped bit, a bad batch (loss spike).
- `stragglers`: one rank slower every step, found from all-gathered per-rank compute times.
- `slow_link`: a straggler caused by one slow ring link, which compute times cannot name; a
  round-trip probe of each link finds it.
- `elastic`: a real ``torchrun --max-restarts`` run: one rank SIGKILLs itself, the agent restarts
  the group, the workers resume from the latest checkpoint to an uninterrupted run's weights, bit
  for bit; with ``--max-restarts=0`` the same kill fails the job.
- `elastic_worker`: the training script `elastic` runs under torchrun (one attempt of one rank).
- `torchft_run`: torchft for real: three replica groups, one SIGKILLed mid-step and restarted; the
  others carry on with a smaller quorum, the killed one heals from a live peer; killing the
  lighthouse stops them all.
- `torchft_replica`: one replica group of that run (its Manager, gloo group and training loop), or
  the lighthouse; every event in its own log.
- `torchft_check`: the figures read from those logs, and a one-process replay that matches them
  bit for bit through the steps with the smaller quorum.
- `oom`: out of memory in backward on one rank under a limit the lab sets: the rank named, its peer
  not left hanging, the run resumed from its checkpoint with recomputation (bit for bit) or with
  smaller micro-batches (within a changed split's rounding).
- `bigram`: the learnable data (a fixed next-token rule) the torchft, compression and DiLoCo labs
  train on, a pure function of (step, replica).
- `compression`: top-k with and without error feedback and int8, built by hand as DDP communication
  hooks, beside PyTorch's 16-bit and PowerSGD hooks: payload and wire bytes per step, loss against DDP.
- `diloco`: DiLoCo through torchft beside torchft's DDP path: bytes per step, loss at H = 1, 8, 32;
  H = 1 with SGD inside and SGD at 1 outside is DDP with SGD, within a derived rounding bound.
- `reliability`: how often a job fails, how often to checkpoint, and what it costs.
"""
