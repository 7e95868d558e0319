"""Chapter 15: the input pipeline as a term of the step: a slow data loader, with and without
prefetching workers.

Each sample takes ``sample_ms`` to load (a sleep: reading and decoding that waits on storage, not
on the CPU). With ``num_workers=0`` the training loop loads each batch itself between steps, and
the trace shows the stall inside ``enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__``
(the annotation torch.utils.data puts around every batch it hands over; `analysis` calls it
input). With worker processes that prefetch (``prefetch_factor`` batches each) the batches are
loaded while the model computes, and the stall shrinks to taking a ready batch from a queue,
as long as the workers together load a batch faster than a step computes it.

Both loaders run in one process, their steps alternated (`overlap.interleaved`), on one rank.
"""
import time

import torch
from torch.utils.data import DataLoader, Dataset

from labs import model as tiny
from labs.launcher import launch
from labs.profiling import targets


class SlowTokens(Dataset):
    """Random token sequences, each taking ``sample_ms`` milliseconds to load."""

    def __init__(self, cfg, length, sample_ms):
        self.cfg, self.length, self.sample_s = cfg, length, sample_ms / 1e3

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        time.sleep(self.sample_s)
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, self.cfg.vocab_size, (self.cfg.seq_len + 1,), generator=g)
        return tokens[:-1], tokens[1:]


def loaders(cfg, batch_size, sample_ms, workers, batches):
    """The same data twice: loaded in the training loop, and by ``workers`` prefetching processes."""
    data = SlowTokens(cfg, batch_size * batches, sample_ms)
    inline = DataLoader(data, batch_size=batch_size)
    ahead = DataLoader(data, batch_size=batch_size, num_workers=workers, prefetch_factor=2,
                       persistent_workers=True)
    return {"a": ahead, "b": inline}


def steps(rank, world_size, batch_size=8, sample_ms=4.0, workers=2, batches=64):
    """Profiled steps: "a" with prefetching workers, "b" loading in the loop; the same model."""
    cfg, dev = targets.config(), launch.device()
    net = tiny.build(cfg, seed=0, device=dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    iters = {k: iter(v) for k, v in loaders(cfg, batch_size, sample_ms, workers, batches).items()}

    def step_with(it):
        def step():
            x, y = (t.to(dev) for t in next(it))
            net(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return {k: step_with(it) for k, it in iters.items()}
