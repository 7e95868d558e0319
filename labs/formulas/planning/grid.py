"""Chapter 14: the planner's candidate, one layout with its settings, as a record of small integers.

A candidate is a layout (`labs.dims.ParallelDims`) with its settings: ZeRO stage, recomputation,
micro-batch size b, virtual stages v (the schedule), micro-batches m, CPU offload, and the stage of
the pipeline being priced. The formulas (`memory`, `traffic`, `timing`) are written on scalars and
price one candidate at a time in plain Python, with no array library, so that the planner also runs
in a browser (Pyodide); `search` prices a million of them by evaluating each piece of a formula once
per distinct value of the integers it reads (`functools.lru_cache` on small integers: cheap to hash).
"""
from typing import NamedTuple

from labs.formulas.planning.software import RECOMPUTE, SCHEDULES

# etp: the tensor-parallel degree of the expert weights, tp, or 1 under Megatron-Core's folding (`fold_ep`)
FIELDS = ("tp", "pp", "cp", "ep", "dp", "dpr", "zero", "rc", "b", "v", "m", "sched", "offload", "reshard",
          "sp", "ckpt", "stage", "etp")


class Candidate(NamedTuple):
    """One candidate; ``rc`` indexes `software.RECOMPUTE`, ``sched`` `software.SCHEDULES`, the flags
    (offload, reshard, sp) are 0 or 1."""
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    dpr: int
    zero: int
    rc: int
    b: int
    v: int
    m: int
    sched: int
    offload: int
    reshard: int
    sp: int
    ckpt: int
    stage: int
    etp: int

    @classmethod
    def of(cls, **fields):
        """A candidate from its fields; ``ckpt`` defaults to 1 (every layer's input kept), ``etp`` to tp."""
        return cls(**{"ckpt": 1, "etp": fields["tp"], **fields})

    @classmethod
    def one(cls, plan, m, stage):
        """The candidate of one layout (a `memory.Plan`) at m micro-batches, priced on ``stage``."""
        d = plan.dims
        return cls.of(tp=d.tp, pp=d.pp, cp=d.cp, ep=d.ep, dp=d.dp, dpr=d.dp_replicate, zero=plan.zero,
                      rc=RECOMPUTE.index(plan.recompute), b=plan.micro_batch, v=plan.v, m=m,
                      sched=SCHEDULES.index(plan.schedule), offload=int(plan.offload),
                      reshard=int(plan.reshard), sp=int(plan.sp), ckpt=plan.checkpoint_every, stage=stage,
                      etp=d.etp)

    def on(self, stage):
        """The same candidate priced on ``stage`` (faster than ``_replace``, which the search would pay
        a million times)."""
        return Candidate._make(self[:16] + (stage, self.etp))

    @property
    def recompute(self):
        return RECOMPUTE[self.rc]
