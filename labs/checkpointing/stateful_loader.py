"""Chapter 12: a data loader whose position is part of the checkpoint.

A restart that rebuilds the loader from scratch replays the epoch's first batches (and, if it
skips ahead by a guess, skips others): the model sees some samples twice and some never, and the
loss curve after the restart is not the one the uninterrupted run would have had. The fix is the
one torchdata's StatefulDataLoader offers: ``state_dict()`` / ``load_state_dict()`` on the loader,
saved with the weights. The state must also survive a change of world size: in torchtitan each
data-parallel rank saved its loader state under its own key, so a checkpoint from 8 GPUs failed to
load on 16 (issue #811), and pull request #816 made any change of data-parallel degree an error.
This loader counts its position in *global* samples, which every world size can resume from.
"""
import torch


class StatefulLoader:
    """Global batches of sample ids, a fresh seeded permutation each epoch; rank r takes its slice.

    The position is kept in *global* samples, so a restart at another world size resumes at the
    same sample; ``state_dict``/``load_state_dict`` as torchdata's StatefulDataLoader has them."""

    def __init__(self, num_samples, global_batch, rank, world_size, seed=0):
        if global_batch % world_size:
            raise ValueError(f"the global batch {global_batch} does not split over {world_size} ranks; "
                             "use a world size that divides it.")
        self.n, self.b, self.rank, self.world, self.seed = num_samples, global_batch, rank, world_size, seed
        self.consumed = 0   # samples taken by all ranks together, since the start of training

    def next(self):
        """This rank's slice of the next global batch; a batch that crosses the end of an epoch
        takes the rest from the next epoch's order, so no sample of either is skipped."""
        parts, start, end = [], self.consumed, self.consumed + self.b
        while start < end:
            epoch, pos = divmod(start, self.n)
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
            parts.append(order[pos:pos + end - start])
            start += len(parts[-1])
        batch = torch.cat(parts)                            # (global_batch,) sample ids
        self.consumed = end
        per = self.b // self.world
        return batch[self.rank * per:(self.rank + 1) * per].tolist()

    def state_dict(self):
        return {"consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state):
        self.consumed, self.seed = int(state["consumed"]), int(state["seed"])
