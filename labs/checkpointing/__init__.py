"""Chapter 12, checkpointing: sharded, committed, verified, resharded.

- `training`: the training run every lab here interrupts (model, optimizer, schedule, loader, and
  a draw from the global RNG every step).
- `sharded_checkpoint`: a hand sharded checkpoint (the interface of DCP): fsynced commit, checksums,
  loaded under any layout, and an asynchronous save.
- `saved_shape`: the load's check that each saved tensor has the target's global shape and dtype.
- `reshard_plan`: which saved byte ranges each rank of a new layout reads (another world size, or
  another split dimension), by the load's own overlap rule: the chapter's picture of resharding.
- `resharding`: save at one world size, load at another, train on: the losses match; a resume that
  forgets Adam's state or the RNG does not.
- `layout_change`: save under one (dp, tp) layout, load under another, by hand and with DCP.
- `pipeline_change`: save under pp = 2 stages, load under pp = 1 and 4, by hand and with DCP; the
  keys each rank reads, and a stage that keys its layers by local names is refused.
- `one_name`: the check before a save: one name, one value wherever ranks overlap (a key several
  ranks save must hold the same bytes on each wherever their elements overlap).
- `key_clash`: two stages that save a layer under one local name: DCP writes one and drops the
  other, the hand format refuses the load; the checked save refuses both in one sentence.
- `async_checkpoint`: an asynchronous save must copy the state (a stager that does not fails), and
  how long training stops for ``dcp.save`` against ``dcp.async_save``.
- `async_window`: the steps a failure loses while an asynchronous save is still in flight.
- `stateful_loader`: a data loader whose position is part of the checkpoint.
- `checkpoint_faults`: a two-rank save killed before its commit, a flipped bit, the fsync order.
- `checkpoint_cost`: what a checkpoint weighs, how long writing it stops training, the exercises.
"""
