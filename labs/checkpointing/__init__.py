"""Chapter 12, checkpointing: sharded, committed, verified, resharded.

- `training`: the training run every lab here interrupts (model, optimizer, schedule, loader, and
  a draw from the global RNG every step).
- `sharded_checkpoint`: a hand sharded checkpoint (the interface of DCP): fsynced commit, checksums,
  loaded under any layout, and an asynchronous save.
- `resharding`: save at one world size, load at another, train on: the losses match; a resume that
  forgets Adam's state or the RNG does not.
- `layout_change`: save under one (dp, tp) layout, load under another, by hand and with DCP.
- `pipeline_change`: save under pp = 2 stages, load under pp = 1 and 4, by hand and with DCP; the
  keys each rank reads, and a stage that keys its layers by local names is refused.
- `async_checkpoint`: an asynchronous save must copy the state (a stager that does not fails), and
  how long training stops for ``dcp.save`` against ``dcp.async_save``.
- `async_window`: the steps a failure loses while an asynchronous save is still in flight.
- `stateful_loader`: a data loader whose position is part of the checkpoint.
- `checkpoint_faults`: a two-rank save killed before its commit, a flipped byte, the fsync order.
- `checkpoint_cost`: what a checkpoint weighs, how long writing it stops training, the exercises.
"""
