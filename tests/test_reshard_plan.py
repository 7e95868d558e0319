"""Chapter 12: the picture of resharding by ranges is what the hand format's load reads.

`reshard_plan.plan` computes, for each rank of a new layout, the saved ranges it copies; these
tests hold it to the real `sharded_checkpoint.load` on committed files, in one process."""
import dataclasses
import hashlib
import json
import os

import pytest
import torch

from labs.checkpointing import reshard_plan as rp, sharded_checkpoint as sc


def _commit(folder, pieces):
    """Commit a hand checkpoint whose rank r wrote ``pieces[r]``, filled with its global indices."""
    os.makedirs(folder)
    names = []
    for r, p in enumerate(pieces):
        filled = dataclasses.replace(p, tensor=rp.global_indices(p).float())
        names += sc._write_rank({"w": filled}, folder, r, lambda path: None)
    sums = {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest() for n in names}
    with open(os.path.join(folder, sc.COMMIT), "w") as f:
        json.dump({"world_size": len(pieces), "sha256": sums}, f)
    return folder


LAYOUTS = {
    "flat 4 -> 2": (rp.flat_shards((10,), 4), rp.flat_shards((10,), 2)),
    "flat 3 -> 4": (rp.flat_shards((10,), 3), rp.flat_shards((10,), 4)),
    "rows 4 -> columns 2": (rp.flat_shards((4, 6), 4), rp.column_shards((4, 6), 2)),
    "columns 3 -> flat 2": (rp.column_shards((4, 6), 3), rp.flat_shards((4, 6), 2)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_plan_is_what_the_load_reads_and_gives_every_element_once(tmp_path, name):
    old, new = LAYOUTS[name]
    path = _commit(str(tmp_path / "step-1"), old)
    reads = rp.plan(old, new)
    got, times = rp.replay(old, new, reads)
    for piece, rs, g, t in zip(new, reads, got, times):
        assert g.equal(rp.global_indices(piece)) and (t == 1).all(), (name, g)
        target = dataclasses.replace(piece, tensor=torch.full_like(piece.tensor, -1.0))
        record = []
        sc.load({"w": target}, path, reads=record)
        assert target.tensor.tolist() == g.float().tolist()          # the real load agrees
        assert [r for _, r in record] == sorted({d["saved_rank"] for d in rs})   # the same files


def test_a_saved_piece_with_a_wrong_offset_leaves_a_gap_and_an_overlap():
    old, new = LAYOUTS["flat 4 -> 2"]
    # the mistake: rank 1 records its piece one element too far on (offset 4 instead of 3)
    shifted = [dataclasses.replace(p, offset=p.offset + (r == 1)) for r, p in enumerate(old)]
    got, times = rp.replay(shifted, new, rp.plan(shifted, new))
    assert times[0].tolist() == [1, 1, 1, 0, 1]          # element 3: no saved piece holds it
    assert times[1].tolist() == [1, 2, 1, 1, 1]          # element 6: rank 1's and rank 2's


def test_columns_that_do_not_split_evenly_are_refused():
    with pytest.raises(ValueError, match="do not split evenly"):
        rp.column_shards((4, 6), 4)
