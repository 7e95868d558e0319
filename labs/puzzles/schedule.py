"""Chapter 16, puzzle 6 (chapter 5 teaches it): the 1F1B schedule written as data.

The reader writes ``one_f_one_b(p, m)``: one list of actions per stage, ``Action("F", i)`` or
``Action("B", i)`` for micro-batch i (`labs.formulas.schedules.Action`). The grader runs the lists
with chapter 5's executor (`labs.pipeline.executor.Executor`: real sends and receives of the tiny
GPT's activations between p gloo ranks, a logical clock of F = 1 and B = 2 work units), at p = 3
stages and m = 4 micro-batches: at p = 2 a warm-up written for two stages (stage 0 one forward, the
others none) passes, at p = 3 it deadlocks. The reference is chapter 5's
`labs.formulas.schedules.one_f_one_b`.

Checked:
- the reader's function runs on the ranks, under the deadline (a loop that never ends stops there,
  not in the notebook); every stage runs F and B of each micro-batch once, B after F, checked
  before the executor starts;
- it finishes: a schedule that deadlocks is stopped at the deadline, the rank that hung and the
  action each stage waits for named (from `labs.formulas.schedules.depends_on`);
- the gradients against one process that runs the micro-batches one at a time, loss / m each, and
  accumulates them in the order the stage runs its backwards: bitwise, since each micro-batch's F
  and B are the same float32 operations on the same values (a stage boundary only copies the
  activation and its gradient) and ``.grad`` adds them up in the same order; a NaN is named as a
  NaN (`grader.nan_in`);
- the bubble in work units against the formula (p - 1)/m over ideal compute (Narayanan et al. 2021);
- the memory: the most micro-batches whose activations each stage holds, at most min(p - s, m),
  with the activation bytes the executor measured.
"""
from fractions import Fraction

import torch

from labs import model as tiny
from labs.formulas import schedules
from labs.formulas.schedules import Action
from labs.pipeline import executor
from labs.puzzles import grader

HINT_HANG = ("a stage's B of micro-batch i waits for the next stage's B of i, and its F for the previous "
             "stage's F: stage s can run p - 1 - s forwards before its first backward, no fewer.")


def check(rank, world_size, fn, m, batch_size=1):
    """On stage ``rank``: build the lists with the reader's function (here, under the deadline), run
    this stage's with the executor; its gradients against one process."""
    lists = [[Action(*a) for a in stage] for stage in fn(world_size, m)]
    wrong = _valid(lists, world_size, m)
    if wrong:
        return {"invalid": wrong, "lists": lists}
    torch.manual_seed(0)
    cfg = executor.config()
    net = tiny.build(cfg, seed=0)
    piece = executor.split(net, world_size)[rank]
    data = executor.microbatches(cfg, m, batch_size)
    ex = executor.Executor([piece], rank, world_size, 1, schedules.costs("1f1b"), 0.0, data, m, cfg.hidden)
    ex.run(lists[rank])
    ref = tiny.build(cfg, seed=0)
    for i in [a.mb for a in lists[rank] if a.kind == "B"]:  # this stage's accumulation order
        x, y = data[i]
        (ref(x, y) / m).backward()
    want = dict(ref.named_parameters())
    nan = next(((n, q.grad) for n, q in piece.named if q.grad.isnan().any()), None)
    error = torch.stack([(q.grad - want[n].grad).abs().max() for n, q in piece.named]).max().item()
    return {"clock": ex.clock, "peak": ex.peak, "peak_bytes": ex.peak_bytes, "error": error, "lists": lists,
            "nan": nan}


def _stuck(lists):
    """Where each stage stops when the lists run in unit time: (stage, action, what it waits for)."""
    p, done, pos = len(lists), set(), [0] * len(lists)
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while pos[s] < len(lists[s]):
                dep = schedules.depends_on(lists[s][pos[s]], s, p, 1)
                if dep is not None and dep not in done:
                    break
                done.add((s, lists[s][pos[s]]))
                pos[s] += 1
                moved = True
    return [(s, lists[s][pos[s]], schedules.depends_on(lists[s][pos[s]], s, p, 1))
            for s in range(p) if pos[s] < len(lists[s])]


def _valid(lists, p, m):
    if len(lists) != p:
        return f"{len(lists)} lists for {p} stages"
    for s, acts in enumerate(lists):
        for i in range(m):
            for kind in "FB":
                count = sum(1 for a in acts if a.kind == kind and a.mb == i)
                if count != 1:
                    return f"stage {s} runs {kind} of micro-batch {i} {count} times, not once"
            if acts.index(Action("B", i)) < acts.index(Action("F", i)):
                return f"stage {s} runs B of micro-batch {i} before its F"
        if any(a.kind not in "FB" or not 0 <= a.mb < m or a.chunk for a in acts):
            return f"stage {s} has an action that is not F or B of a micro-batch 0..{m - 1}"
    return None


def grade(fn, p=3, m=4, deadline=15.0):
    results = grader.run(check, fn, p, deadline, HINT_HANG, m=m)
    if isinstance(results, grader.Grade):
        if results.hint == HINT_HANG:
            # the ranks built their lists, then waited on each other: the same function builds them here
            waits = "; ".join(f"stage {s} waits in {a!r} for stage {d[0]}'s {d[1]!r}"
                              for s, a, d in _stuck([[Action(*a) for a in st] for st in fn(p, m)]))
            results.lines[0] += f" ({waits})" if waits else ""
        return results
    if "invalid" in results[0]:
        return grader.Grade(False, [results[0]["invalid"]],
                            "each stage runs F then B of every micro-batch exactly once.")
    for s, r in enumerate(results):
        if r["nan"]:
            return grader.nan_in(f"stage {s}", f"gradient of {r['nan'][0]}", r["nan"][1])
        if not r["error"] == 0:
            return grader.Grade(False, [f"stage {s}'s gradients differ from one process by {r['error']:.2g}"
                                        " (one process runs the same micro-batches in the stage's "
                                        "backward order: the same float32 operations, so bitwise)"],
                                "every micro-batch needs its F and its B on every stage, in a legal order.")
    busy = 3 * m
    total = max(r["clock"] for r in results)
    bubble, want = Fraction(total - busy).limit_denominator(1000) / busy, Fraction(p - 1, m)
    if bubble != want:
        return grader.Grade(False, [f"the bubble is {bubble} of ideal compute; 1F1B's is (p-1)/m = {want}"],
                            "stage s runs min(p - 1 - s, m) warm-up forwards, then one forward and one "
                            "backward in turn: a warm-up written for one p stalls the stages at another.")
    for s, r in enumerate(results):
        allowed = min(p - s, m)
        if r["peak"] > allowed:
            each = r["peak_bytes"] // r["peak"]
            return grader.Grade(False, [
                f"stage {s} held {r['peak']} micro-batches' activations at once ({r['peak_bytes']:,} bytes "
                f"measured); 1F1B holds min(p - s, m) = {allowed}: {(r['peak'] - allowed) * each:,} bytes "
                f"too many"],
                "the bubble alone does not tell 1F1B from GPipe: after its warm-up a stage alternates one F "
                "and one B, so it never holds more than p - s micro-batches.")
    return grader.Grade(True, [
        f"1F1B with p = {p} stages and m = {m} micro-batches, run by chapter 5's executor",
        "gradients: one process's, bitwise (the micro-batches one at a time, in each stage's backward "
        "order)",
        f"bubble: (p-1)/m = {want} of ideal compute, in work units",
        "micro-batches held per stage: " + ", ".join(str(r["peak"]) for r in results) +
        f" (stage 0: {results[0]['peak_bytes']:,} bytes of activations measured)"])
