"""Chapter 5's calculator: the pipeline bubble of a schedule, `schedules.formula`."""
from labs.formulas import fields, schedules
from labs.formulas.fields import Field

FIELDS = (Field("schedule", "schedule", "choice", "1f1b", ("gpipe", "1f1b", "interleaved", "zb-h1")),
          Field("p", "stages p", "int", "8"),
          Field("m", "micro-batches m", "int", "32"),
          Field("v", "chunks per stage v", "int", "1", help="interleaved 1F1B only"))


def answer(values):
    name = fields.choice(values, FIELDS[0])
    p, m, v = (fields.whole(values, f) for f in FIELDS[1:])
    if v != 1 and name != "interleaved":
        raise ValueError(f"v = {v} chunks per stage applies to the interleaved schedule only; use 1 for "
                         f"{name}.")
    f = schedules.formula(name, p, m, v)
    chunks = f" and v = {v} chunks" if name == "interleaved" else ""
    return {"ok": True,
            "summary": f"{name} on p = {p} stages with m = {m} micro-batches{chunks}: the bubble is "
                       f"{f['over_total']:.1%} of the step ({f['over_ideal']:.1%} over the ideal time).",
            "table": {"head": ["bubble", "share"],
                      "rows": [["over the ideal time", f"{f['over_ideal']:.1%}"],
                               ["of the whole step", f"{f['over_total']:.1%}"]]}}
