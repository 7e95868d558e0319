"""Chapter 14's calculator: which layout, for this model, on these GPUs?

`planner.plan` (chapter 14) on the reader's job: every layout of tp x pp x cp x ep x dp that multiplies
to the GPUs, refused by a rule or by memory, the rest ranked by the estimated step time, at the
recorded efficiency of the GPU's generation and precision (`calibrated.ETA`). The answer gives the
first layouts with their memory, headroom and step-time terms, and what puts the first ahead of the
second. The planner's memory is its own count of tensors (what the allocator hands out), and headroom is
what the GPU has left beyond it. Layouts whose count fits the GPU are ranked: published runs that ran reach
its last GiB by the same count, so no reserve is held back (`shapes.RESERVE` is an assumption, not a limit).
"""
import dataclasses
import re

from labs.formulas import fields, memory
from labs.formulas.fields import Field
from labs.formulas.planning import calibrated, planner, shapes, software
from labs.formulas.shape import ModelShape

CUSTOM = "custom"
MODELS = {**{k: v for k, v in memory.MODELS.items()}, "DeepSeek-V3": shapes.DEEPSEEK_V3}
CLUSTERS = {"H100 80GB (DGX H100)": shapes.DGX_H100, "A100 80GB (DGX A100)": shapes.SELENE,
            "H100 96GB (Grand Teton)": shapes.GRAND_TETON}
STACKS = {"any": software.ANY, "Megatron-Core": software.MEGATRON_CORE, "torchtitan": software.TORCHTITAN}
SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
MOE = ("experts", "top_k", "expert_ffn")
_70B = memory.MODELS["70B"]
FIELDS = (
    Field("model", "model", "choice", "70B", tuple(MODELS) + (CUSTOM,),
          help="a preset, or custom: the shapes below"),
    *(Field(k, label, "int", str(getattr(_70B, k)), help="custom model only")
      for k, label in zip(SHAPE, ("layers L", "hidden size h", "heads a", "KV heads", "MLP width f",
                                  "vocabulary V"))),
    Field("experts", "routed experts", "int", "0", help="custom model only; 0: dense"),
    Field("top_k", "experts per token", "int", "0", help="custom model only; with experts"),
    Field("expert_ffn", "expert width", "int", "0", help="custom model only; with experts"),
    Field("gpus", "GPUs", "int", "64"),
    Field("cluster", "GPU", "choice", tuple(CLUSTERS)[0], tuple(CLUSTERS)),
    Field("batch_tokens", "global batch (tokens)", "int", "4194304"),
    Field("seq", "sequence length s", "int", "4096"),
    Field("precision", "matmul precision", "choice", "bf16", ("bf16", "fp8")),
    Field("stack", "training stack", "choice", "any", tuple(STACKS)),
)
F = {f.name: f for f in FIELDS}
TOP = 5
GIB = 2 ** 30
TERMS = (("compute", "compute"), ("bubble", "bubble"), ("exposed", "exposed communication"),
         ("dp", "data-parallel tail"), ("optimizer", "optimizer step"))


def model_of(values):
    seq = fields.whole(values, F["seq"])
    name = fields.choice(values, F["model"])
    if name != CUSTOM:
        return dataclasses.replace(MODELS[name], seq=seq)
    shape = {k: fields.whole(values, F[k]) for k in SHAPE}
    moe = {k: fields.whole(values, F[k], least=0) for k in MOE}
    return ModelShape("custom model", **shape, seq=seq, **moe)


def terms(row):
    t = row["time"]
    exposed = t["exposed_tp"] + t["exposed_cp"] + t["exposed_ep"] + t["exposed_pp"]
    return {"compute": t["compute"], "bubble": t["bubble"], "exposed": exposed, "dp": t["dp"],
            "optimizer": t["optimizer"]}


def layout(row):
    d, p = row["dims"], row["plan"]
    return f"TP {d.tp} PP {d.pp} CP {d.cp} EP {d.ep} DP {d.dp}{planner.hsdp(d)}", \
        f"ZeRO-{p.zero}, recompute {p.recompute}, b {p.micro_batch}, v {p.v}"


def why(first, second):
    """What puts the first layout ahead of the second: the gap, and the term that makes most of it."""
    a, b = terms(first), terms(second)
    gap = second["time"]["step"] - first["time"]["step"]
    key = max(a, key=lambda k: b[k] - a[k])
    label = dict(TERMS)[key]
    return (f"It is {gap / second['time']['step']:.1%} faster than the second ({layout(second)[0]}), "
            f"mostly in its {label}: {a[key]:,.2f} s against {b[key]:,.2f} s.")


def most_refused(result):
    """The rule or memory term that refused the most layouts (rules counted alike whatever their degrees),
    one example of its sentence, and how many it refused."""
    counts, example = {}, {}
    for r in result["rejected"]:
        reason = r["term"] + " overflows the GPU" if r["kind"] == "memory" else r["reason"]
        key = re.sub(r"[0-9][0-9,.]*", "#", reason)
        counts[key] = counts.get(key, 0) + 1
        example.setdefault(key, reason)
    key = max(counts, key=counts.get)
    return example[key], counts[key]


def job_of(values, model=None):
    """The job the form's values describe (``model``: a shape given otherwise, e.g. from a config.json),
    checked: (job, the GPU's name)."""
    gpu = fields.choice(values, F["cluster"])
    job = planner.Job(model or model_of(values), CLUSTERS[gpu], fields.whole(values, F["gpus"]),
                      fields.whole(values, F["batch_tokens"]), STACKS[fields.choice(values, F["stack"])],
                      fields.choice(values, F["precision"]))
    job.check()
    return job, gpu


def answer(values, model=None, eta=None, top=TOP):
    """The form's answer; ``eta`` defaults to the generation's recorded one (`calibrated.ETA`)."""
    job, gpu = job_of(values, model)
    if eta is None:
        eta = calibrated.eta(job.cluster.generation, job.precision)
    planner.check_eta(eta)
    return describe(job, gpu, planner.plan(job, eta), top)


def describe(job, gpu, result, top=TOP):
    model, ranked, hbm = job.model, result["ranked"], job.cluster.hbm_bytes / GIB
    head = f"{model.name} at s = {model.seq:,} on {job.gpus:,} GPUs, {gpu}"
    if not ranked:
        reason, n = most_refused(result)
        return {"ok": True, "summary": f"{head}: no layout fits. Of the {len(result['rejected']):,} layouts, "
                                       f"{n:,} were refused for one reason, as in: {reason}.",
                "table": {"head": ["layouts refused", "for the most common reason", "as in"],
                          "rows": [[f"{len(result['rejected']):,}", f"{n:,}", reason]]}}
    first = ranked[0]
    peak = sum(first["memory"].values()) / GIB
    summary = (f"{head}: {len(ranked):,} layouts fit, {len(result['rejected']):,} are refused. The fastest "
               f"is {layout(first)[0]} with {layout(first)[1]}: {first['time']['step']:,.2f} s per step, "
               f"{planner.tflops_per_gpu(job, first):,.0f} TFLOP/s per GPU, {peak:,.1f} GiB of tensors by "
               f"the planner's count, {hbm - peak:,.1f} of {hbm:g} GiB of headroom. ")
    summary += why(first, ranked[1]) if len(ranked) > 1 else "It is the only layout that fits."
    rows = []
    for r in ranked[:top]:
        t, mem = terms(r), sum(r["memory"].values()) / GIB
        rows.append([str(r["rank"]), *layout(r), f"{r['time']['step']:,.2f}",
                     f"{planner.tflops_per_gpu(job, r):,.0f}", *(f"{t[k]:,.2f}" for k, _ in TERMS),
                     f"{mem:,.1f}", f"{hbm - mem:,.1f}"])
    bars = [(f"#{r['rank']}", [(label, terms(r)[k]) for k, label in TERMS]) for r in ranked[:top]]
    return {"ok": True, "summary": summary,
            "table": {"head": ["rank", "layout", "settings", "step (s)", "TFLOP/s per GPU",
                               *(f"{label} (s)" for _, label in TERMS), "tensors (GiB)", "headroom (GiB)"],
                      "rows": rows},
            "svg": fields.stacked_bars_svg(bars, "seconds per step, by term")}
