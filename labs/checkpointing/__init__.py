"""Chapter 12, checkpointing: sharded, atomic, verified, resharded.

- `training`: the training run every lab here interrupts (model, optimizer, schedule, loader).
- `sharded_checkpoint`: a hand sharded checkpoint (the interface of DCP): atomic commit, checksums,
  loaded at any world size.
- `resharding`: save at one world size, load at another, train on: the losses match.
- `async_checkpoint`: how long training stops for ``dcp.save`` against ``dcp.async_save``.
- `stateful_loader`: a data loader whose position is part of the checkpoint.
- `checkpoint_faults`: a writer killed half-way, and a flipped byte, against the safeguards.
- `checkpoint_cost`: what a checkpoint weighs and how long writing it stops training.
"""
