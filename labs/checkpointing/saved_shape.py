"""Chapter 12: the checks `sharded_checkpoint.load` makes before it copies a key: the saved tensor is
the one asked for, and its saved pieces tile this rank's elements.

Coverage alone (`check_covered`) compares flat index ranges, so a weight saved
as (4, 8) would fill a (2, 8) target with its first 16 elements, or a (8, 4) target with all 32 in
the wrong places, and a bf16 target would be cast silently. A changed config, a resized vocabulary
or a non-square weight saved transposed all look like that. DCP refuses a size mismatch; so does this
check. A square weight saved transposed has the same shape and passes it: only comparing values
catches that.
"""


class CoverageError(RuntimeError):
    """Saved pieces that do not cover what a rank asks for exactly once (a gap or an overlap)."""


class SavedShapeMismatch(ValueError):
    """A saved tensor whose global shape, element count or dtype is not the target's."""


def check_same_tensor(checkpoint_id, key, shape, dtype, entries):
    """Refuse, before a byte is copied, ``entries`` (the saved index entries of ``key``, one per rank
    that wrote it) whose global shape or dtype differs from the target's ``shape`` and ``dtype``
    (a torch.dtype), or whose runs do not add up to the elements the entry stores."""
    want = (list(shape), str(dtype).removeprefix("torch."))
    for rank, e in entries:
        got = (list(e["shape"]), e["dtype"])
        stored = sum(b - a for a, b in e["runs"])
        if got != want or stored != e["numel"]:
            raise SavedShapeMismatch(
                f"checkpoint {checkpoint_id}: {key!r} was saved (rank {rank}) as shape {tuple(got[0])} "
                f"{got[1]} with {e['numel']} elements stored, the target is {tuple(want[0])} {want[1]}; "
                "the model differs from the one saved (a changed config, a resized vocabulary, a "
                "non-square weight transposed), so the load is refused.")


def check_covered(checkpoint_id, key, covered):
    """The saved runs must tile this rank's runs: every element copied exactly once."""
    gaps, twice = int((covered == 0).sum()), int((covered > 1).sum())
    if gaps or twice:
        raise CoverageError(f"checkpoint {checkpoint_id}: the saved pieces of {key!r} leave {gaps} of this "
                            f"rank's {covered.numel()} elements uncovered and cover {twice} more than once; "
                            "the save and the load disagree about the layout (a wrong offset, a missing "
                            "rank, or two tensors under one name).")
