"""Chapter 13: the data the torchft, compression and DiLoCo labs train the tiny GPT on.

Each sequence follows one fixed rule, token t is followed by ``NEXT[t]`` (a random permutation
of the vocabulary), from a random first token: a rule the tiny GPT learns in a few dozen steps,
so a loss curve shows progress and a change to the training shows up in it. (The uniform random
tokens of `labs.model.synthetic_batch` have nothing to learn beyond the uniform distribution.)
Every batch is a pure function of (step, replica): a replica that misses a step simply never
sees its rows of it, and any run can be replayed exactly.
"""
import torch

from labs import model as tiny

CFG = tiny.GPTConfig()
BATCH = 4          # sequences per replica per step
HELD_OUT = 10**6   # seed of the held-out batch


def sequences(n, seed):
    """``n`` sequences of the rule from random first tokens: (n, T) inputs, (n, T) next tokens."""
    first = torch.randint(0, CFG.vocab_size, (n, 1), generator=torch.Generator().manual_seed(seed))
    tokens = [first]
    for _ in range(CFG.seq_len):
        tokens.append(NEXT[tokens[-1]])
    tokens = torch.cat(tokens, dim=1)                       # (n, T + 1)
    return tokens[:, :-1], tokens[:, 1:]


NEXT = torch.randperm(CFG.vocab_size, generator=torch.Generator().manual_seed(7))


def batch(step, replica):
    """Replica ``replica``'s rows of step ``step``."""
    return sequences(BATCH, seed=1000 * step + replica)


def held_out_loss(model):
    """The loss on a fixed batch no replica trains on: a function of the weights only."""
    x, y = sequences(4 * BATCH, seed=HELD_OUT)
    dev = next(model.parameters()).device
    x, y = x.to(dev), y.to(dev)
    with torch.no_grad():
        return model(x, y).item()
