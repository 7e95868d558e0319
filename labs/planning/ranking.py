"""Chapter 14: the planner's ranking judged by measures that can fail (`checked.evaluate_all`'s results).

- pairwise order: where one source publishes several layouts of the same job (same model, GPUs, sequence,
  batch and precision), does the planner order each pair as the measurements do? Each pair is judged twice:
  by the planner's estimate of each published run at the settings its source states (``stated``: like for
  like with the measurement) and by each layout's place in the planner's own ranking, every layout at its
  fastest setting (``ranked``). A pair the source measures equal has no order to check and is listed apart.
- strict top three: the published layout among the planner's three fastest, only for jobs with at least
  `MIN_LAYOUTS` fitting layouts whose source says the layout was chosen for speed (`TUNED`, in its words).
- out of memory: layouts a source says did not fit, which the planner must refuse (`OUT_OF_MEMORY`).
- least memory: a published layout's count at the least-memory choice of every setting its source leaves
  open (`least_memory`), for judging a memory limit against rows the search did not fill in.
"""
import dataclasses
import itertools

from labs.dims import ParallelDims
from labs.formulas.planning import memory, planner

MIN_LAYOUTS = 6
# source (as `cases.Case.source` begins) -> its words that the layout was picked for speed
TUNED = {
    "Narayanan et al. 2021, Table 1": "\"using tensor, pipeline, and data parallelism (degrees picked using "
                                      "heuristics described in §3)\" (Narayanan et al. 2021, §5.1)",
}
# (name, the checked row whose job it changes, GPUs, the source's words): Narayanan et al. 2021, Table 2's
# caption: the 529.6B model "did not fit on 560 GPUs when using a microbatch size of 4 with ZeRO-3"; its job
# is the Table's 529.6B ZeRO-3 job (batch 2,240 sequences of 2,048) on 560 GPUs, DP 560, b = 4
OUT_OF_MEMORY = (
    ("Narayanan ZeRO-3 529.6B, 560 GPUs, b = 4", "Narayanan ZeRO-3 529.6B, 1120 GPUs", 560,
     {"micro_batch": 4},
     "\"The 530-billion-parameter GPT model did not fit on 560 GPUs when using a microbatch size of 4 with "
     "ZeRO-3\" (Narayanan et al. 2021, Table 2 caption, §5.2)"),
)


def job_key(case):
    """What makes two published rows the same job: the source's paper or page, the model, GPUs, sequence,
    batch and precision."""
    j = case.job
    return case.source.split(",")[0], j.model.name, j.gpus, j.model.seq, j.batch_tokens, j.precision


def pairs(results):
    """Every pair of distinct published layouts of one job: {"job", "faster", "slower" (names, by the
    measurement), "published" (TFLOP/s, faster first), "estimated" (TFLOP/s at the stated settings),
    "stated", "ranked" (each: "ordered", "reversed"), or "measured equal" for both when the source's
    figures are equal}."""
    groups = {}
    for r in results:
        if r["case"].tflops and not r.get("calibration"):   # a fitted row is no test of the model
            groups.setdefault(job_key(r["case"]), []).append(r)
    out = []
    for key, rows in groups.items():
        for a, b in itertools.combinations(rows, 2):
            if a["case"].published == b["case"].published:
                continue             # the same layout on another stack or setting: not a choice of layout
            if a["case"].tflops < b["case"].tflops:
                a, b = b, a
            tie = a["case"].tflops == b["case"].tflops
            verdict = lambda faster: "measured equal" if tie else "ordered" if faster else "reversed"  # noqa
            # the stack compared whole (a switch such as Megatron-Core's 1F1B all-to-all overlap keeps
            # its name), and the recomputation in the source's words ("norm, act" runs as "none")
            also = [k for k, x, y in (("stack", a["case"].job.software, b["case"].job.software),
                                      ("settings", a["case"].fixed, b["case"].fixed),
                                      ("recomputation", a["case"].recompute_words,
                                       b["case"].recompute_words)) if x != y]
            out.append({"job": key, "faster": a["case"].name, "slower": b["case"].name, "also": also,
                        "moe": bool(a["case"].job.model.moe),
                        "published": (a["case"].tflops, b["case"].tflops),
                        "estimated": (a["estimate"], b["estimate"]),
                        "stated": verdict(a["row"]["time"]["step"] < b["row"]["time"]["step"]),
                        "ranked": verdict(a["listed"]["time"]["step"] < b["listed"]["time"]["step"])})
    return out


def pairwise_order(results):
    """{"pairs": pairs with an order, "stated", "ranked": how many of them the planner orders as measured,
    "dense", "dense_ordered", "moe", "moe_ordered": the same at stated settings by the model's kind,
    "confounded": pairs whose two rows also differ in stack or stated settings ("also"), "measured_equal":
    pairs the source measures equal, "list": `pairs`}."""
    ps = pairs(results)
    ordered = [p for p in ps if p["stated"] != "measured equal"]
    kind = {k: [p for p in ordered if p["moe"] == (k == "moe")] for k in ("dense", "moe")}
    return {"pairs": len(ordered), "stated": sum(p["stated"] == "ordered" for p in ordered),
            "ranked": sum(p["ranked"] == "ordered" for p in ordered),
            **{k: len(v) for k, v in kind.items()},
            **{f"{k}_ordered": sum(p["stated"] == "ordered" for p in v) for k, v in kind.items()},
            "confounded": sum(bool(p["also"]) for p in ordered),
            "measured_equal": len(ps) - len(ordered), "list": ps}


def tuned_source(case):
    """The source's words that its layout was tuned, or None."""
    return next((words for src, words in TUNED.items() if case.source.startswith(src)), None)


def top3_tuned(results):
    """{"rows": [(name, rank, fitting layouts)], "top3": how many rank 1 to 3, "left_out": rows of tuned
    sources whose job has fewer than `MIN_LAYOUTS` fitting layouts}: the strict top three, over the
    predictions (a calibration row, annotated by `scorecard.annotate`, is the fit and not counted)."""
    tuned = [r for r in results if r["case"].tflops and tuned_source(r["case"]) and not r.get("calibration")]
    rows = [(r["case"].name, r["rank"], r["of"]) for r in tuned if r["of"] >= MIN_LAYOUTS]
    return {"rows": rows, "top3": sum((rank or 99) <= 3 for _, rank, _ in rows),
            "left_out": [r["case"].name for r in tuned if r["of"] < MIN_LAYOUTS]}


def assumed_fp32_grad_bytes(job, row):
    """The part of a DeepSpeed ZeRO-3 row's count that rests on FSDP2's buffers, not its own stack's:
    an fp32 copy of the unit's gradient (`memory.fsdp_buffer_bytes`), the unit one weight at a time.
    No source gives DeepSpeed 2021's; 0 for any other row."""
    if row["plan"].zero != 3 or job.software.shard_unit != "weight":
        return 0
    return 4 * max(memory.local_numel(w, row["dims"].tp, 1, job.model.kv_heads)
                   for w in job.model.layer_weights(0))


def out_of_memory(checked_cases, eta_for):
    """Each `OUT_OF_MEMORY` case through `planner.published`: [{"name", "refused", "reason", "gib",
    "fp32_grad_gib", "words"}];
    ``eta_for``: a case's calibrated eta (`checked.eta_for`)."""
    by_name = {c.name: c for c in checked_cases}
    out = []
    for name, base, gpus, fixed, words in OUT_OF_MEMORY:
        case = by_name[base]
        job = dataclasses.replace(case.job, gpus=gpus)
        dims = ParallelDims(tp=case.published.tp, pp=case.published.pp, cp=case.published.cp,
                            dp=gpus // (case.published.tp * case.published.pp * case.published.cp))
        row = planner.published(job, dims, eta_for(case), {**case.fixed, **fixed})
        out.append({"name": name, "refused": not row["fits"], "reason": row.get("reason"),
                    "gib": sum(row["memory"].values()) / 2 ** 30,
                    "fp32_grad_gib": assumed_fp32_grad_bytes(job, row) / 2 ** 30, "words": words})
    return out


# Rows whose memory rests on settings their source does not state, though the row fixes them (the least-memory
# count cannot stand for them): DeepSeek-V2 recomputes "a portion of the operators" (§3.1.3; the row takes
# selective) and prints no GPU count (`checked`: 1,024 assumed, and ZeRO-1's share falls as dp grows).
NOT_STATED = ("DeepSeek-V2",)


def least_memory(case, eta):
    """The published layout's count at the least-memory choice of every setting its source leaves open:
    each ZeRO stage and recomputation the stack offers where the source states none, b = 1 and, with a
    pipeline, v = 1 where it states none. (bytes, the settings): a bound below the count at any setting the
    source allows, so a row above a limit here is above it whatever the unstated settings were."""
    sw, f = case.job.software, case.fixed
    best = None
    for zero, rc in itertools.product([f["zero"]] if "zero" in f else sw.zero_stages,
                                      [f["recompute"]] if "recompute" in f else sw.recompute):
        fixed = {**f, "zero": zero, "recompute": rc, "micro_batch": f.get("micro_batch", 1)}
        if case.published.pp > 1:
            fixed["v"] = f.get("v", 1)
        row = planner.published(case.job, case.published, eta, fixed)
        total = sum(row["memory"].values())
        if best is None or total < best[0]:
            best = (total, fixed)
    return best
