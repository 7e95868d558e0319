"""The launcher, shared by every chapter: run a lab function on N ranks, from a notebook, a test or torchrun.

- `launch`: ``spawn(fn, world_size, *args)`` and ``launch`` (spawn, or join torchrun's ranks);
  the failing or hung rank is named, no process or file outlives the call.
- `preflight`: what is refused before any rank starts (world size, timeout, memory) and the backend.
- `_rank`: the first code a rank runs (a fresh interpreter, or forked from the zygote).
- `zygote`: ranks forked from a process that imported torch once, so a rank starts in milliseconds.
- `supervise`: the launcher's side of a run: wait, collect results, name the rank that failed.
- `heartbeat`: where each rank is, a few times a second: how a hung rank is named.
- `torchrun`: the same promises inside torchrun's ranks (watchdog, error file).
- `cli`: the command-line contract every lab keeps (``--world-size``, ``--timeout``, ``--json``).
- `hello`: the smallest lab, ``python -m labs.launcher.hello``: start N ranks, time it, inject a fault.
- `under_load`: ``python -m labs.launcher.under_load``: 50 launches in a row while other processes
  keep every core busy, the failures counted (the start-up races it found are fixed in `_rank` and
  `zygote`).
"""
