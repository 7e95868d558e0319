"""Chapter 14: the planner's candidates as columns, so one formula prices thousands of layouts at once.

A candidate is a layout (`labs.dims.ParallelDims`) with its settings: ZeRO stage, recomputation,
micro-batch size b, virtual stages v (the schedule), micro-batches m, CPU offload, and the stage of
the pipeline being priced. `Columns` holds one numpy array per field, one entry per candidate; a
single layout is the same thing with one entry (`Columns.one`). The formulas (`memory`, `traffic`,
`timing`) are written once, on scalars, and `per_unique` evaluates a scalar formula on each distinct
row of its arguments and spreads the results back: the planner's inner loop is numpy, the
arithmetic stays readable.
"""
import math

import numpy as np

from labs.planning.software import RECOMPUTE, SCHEDULES

# etp: the tensor-parallel degree of the expert weights, tp, or 1 under Megatron-Core's folding (`fold_ep`)
FIELDS = ("tp", "pp", "cp", "ep", "dp", "dpr", "zero", "rc", "b", "v", "m", "sched", "offload", "reshard",
          "sp", "ckpt", "stage", "etp")


class Columns(dict):
    """{field: int64 array}; ``rc`` indexes `software.RECOMPUTE`, ``sched`` `software.SCHEDULES`."""

    def __len__(self):
        return len(self["tp"])

    @classmethod
    def of(cls, **fields):
        n = max(np.size(v) for v in fields.values())
        fields = {"ckpt": 1, "etp": fields["tp"], **fields}
        return cls({k: np.broadcast_to(np.asarray(fields[k], dtype=np.int64), (n,)).copy() for k in FIELDS})

    @classmethod
    def one(cls, plan, m, stage):
        """The columns of one layout (a `memory.Plan`) at m micro-batches, priced on ``stage``."""
        d = plan.dims
        return cls.of(tp=d.tp, pp=d.pp, cp=d.cp, ep=d.ep, dp=d.dp, dpr=d.dp_replicate, zero=plan.zero,
                      rc=RECOMPUTE.index(plan.recompute), b=plan.micro_batch, v=plan.v, m=m,
                      sched=SCHEDULES.index(plan.schedule), offload=int(plan.offload),
                      reshard=int(plan.reshard),
                      sp=int(plan.sp), ckpt=plan.checkpoint_every, stage=stage, etp=d.etp)

    def take(self, index):
        return Columns({k: v[index] for k, v in self.items()})

    @property
    def recompute(self):
        return np.asarray(RECOMPUTE)[self["rc"]]


def per_unique(fn, *columns):
    """fn(*row) for every row of the integer ``columns``, computed once per distinct row: a float
    array, or a tuple of float arrays when fn returns a tuple."""
    cols = [np.asarray(c, dtype=np.int64) for c in columns]
    radix = [int(c.max()) + 1 for c in cols]
    if math.prod(radix) < 2 ** 62:                   # one integer per row, mixed radix
        key = np.zeros(len(cols[0]), dtype=np.int64)
        for c, r in zip(cols, radix):
            key = key * r + c
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(np.stack(cols, axis=1), axis=0, return_index=True, return_inverse=True)
    values = [fn(*row) for row in np.stack(cols, axis=1)[first].tolist()]
    inverse = inverse.reshape(-1)
    if isinstance(values[0], tuple):
        return tuple(np.asarray([v[i] for v in values], dtype=float)[inverse] for i in range(len(values[0])))
    return np.asarray(values, dtype=float)[inverse]
