"""Chapter 14: the planner. Every layout of a job, the rules each breaks, what does not fit, and a ranking.

A job is a model (chapter 1's `ModelShape`), a cluster (`shapes.Cluster`), a number of GPUs and a
global batch in tokens, with the precision recipe (chapter 1's `recipes.RECIPES`) and the kernels
(`memory.KERNELS`) its software runs. The planner enumerates the degrees tp x pp x cp x ep x dp that
multiply to the GPUs (each a `labs.dims.ParallelDims`), and for each the ZeRO stage, recomputation,
micro-batch size b and virtual stages v. A layout is refused for the first rule it breaks:

- tensor parallelism beyond a node (chapters 4 and 11: its all-reduces would cross the network);
- heads that tp does not divide (chapter 4's `gqa_parallel.kv_layout`), or a vocabulary, layers or
  experts that a degree does not divide into at least one each;
- a global batch that does not split into dp x b sequences per micro-batch, or an interleaved
  schedule whose m is not a multiple of p (chapter 5's `schedules.interleaved`);
- context parallelism with attention scores written out (chapter 6's methods attend block by block),
  or a sequence that does not split into 2 cp chunks (chapter 6's zig-zag order);

and otherwise for the first memory term that overflows the GPU (`memory.overflow`). The layouts
that fit are ranked by `timing.step_time`; each degree tuple is shown at its fastest setting of the
other knobs, so "rank" is among degree tuples.
"""
from dataclasses import dataclass

from labs.dims import ParallelDims
from labs.memory_budget import recipes
from labs.memory_budget.model_shape import ModelShape
from labs.planning import memory, shapes, timing
from labs.tensor_parallel import gqa_parallel

RECOMPUTE = ("none", "selective", "full")   # cheapest first: the first that fits is the fastest
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Job:
    model: ModelShape
    cluster: shapes.Cluster
    gpus: int
    batch_tokens: int
    recipe: str = "mixed"
    kernels: str = "fused"
    # what the training software offers (a published system states its own)
    zero_stages: tuple = (0, 1, 2, 3)
    recompute: tuple = ("none", "selective", "full")
    sp: bool = True

    @property
    def sequences(self):
        return self.batch_tokens // self.model.seq

    @property
    def grad_bytes(self):
        """Bytes of a gradient element as it is reduced: the recipe's gradient bytes per parameter."""
        return recipes.recipe(self.recipe).bytes_per_param()["gradients"]

    def check(self):
        if self.batch_tokens % self.model.seq:
            raise ValueError(f"a batch of {self.batch_tokens:,} tokens is not a whole number of {self.model.seq:,}-token "
                             f"sequences; give a multiple of the sequence length.")
        if self.kernels not in memory.KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(memory.KERNELS)}, got {self.kernels!r}.")
        if self.gpus < 1:
            raise ValueError(f"the job needs at least one GPU, got {self.gpus}.")
        recipes.recipe(self.recipe)


def _divisors(n, most):
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def degree_tuples(job):
    """Every `ParallelDims` (tp, pp, cp, ep, dp) whose product tp pp cp dp is the GPUs (ep divides dp)."""
    m, n = job.model, job.gpus
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if n % t == 0]
    for tp in tps:
        for pp in _divisors(n // tp, m.layers):
            for cp in [c for c in (1, 2, 4, 8, 16, 32) if (n // (tp * pp)) % c == 0]:
                dp = n // (tp * pp * cp)
                for ep in (_divisors(dp, m.experts) if m.moe else [1]):
                    yield ParallelDims(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp)


def broken_rule(job, d):
    """The first rule the degrees ``d`` break, in one sentence; None if they break none."""
    m, c = job.model, job.cluster
    if d.tp > c.gpus_per_node:
        return f"tp = {d.tp} reaches beyond a node of {c.gpus_per_node} GPUs"
    try:
        gqa_parallel.kv_layout(m.heads, m.kv_heads, d.tp)
    except ValueError as exc:
        return str(exc).rstrip(".")
    if job.sequences % d.dp:
        return f"the batch of {job.sequences:,} sequences does not split over dp = {d.dp}"
    if d.cp > 1 and job.kernels == "materialized":   # chapter 6's methods attend block by block
        return "context parallelism needs a fused attention kernel, not scores written out"
    if d.cp > 1 and m.seq % (2 * d.cp):
        return f"the sequence of {m.seq:,} tokens does not split into 2 cp = {2 * d.cp} chunks"
    if m.moe and m.experts % d.ep:
        return f"{m.experts} experts do not split over ep = {d.ep}"
    return None


def _settings(job, d):
    """(b, v, m, ZeRO stages) to try for degrees ``d``."""
    zeros = job.zero_stages if d.dp * d.cp > 1 else (0,)
    for b in MICRO_BATCHES:
        if job.sequences % (d.dp * b):
            continue
        m = job.sequences // (d.dp * b)
        for v in range(1, 9 if d.pp > 1 else 2):
            # every chunk holds a layer, but the first and the last may hold only the embedding and
            # the head (Llama 3's 126 layers on 16 x 8 chunks, §3.3.2; `stage_balance.stage_layers`)
            if d.pp * v > job.model.layers + 2 or (v > 1 and m % d.pp):
                continue
            yield b, v, m, zeros


def fits(job, plan, m):
    """(the overflowing term or None, {term: bytes} of the fullest stage, that stage). The first,
    a middle and the last stage are checked: the embedding, the most layers, the head and logits."""
    worst = None
    for stage in sorted({0, plan.dims.pp // 2, plan.dims.pp - 1}):
        terms = memory.rank_memory_terms(job.model, plan, job.recipe, job.kernels, m, stage)
        total = sum(terms)
        if worst is None or total > worst[0]:
            worst = (total, terms, stage)
    return memory.overflow(worst[1], job.cluster.hbm_bytes), dict(zip(memory.TERMS, worst[1])), worst[2]


def best_for(job, d, eta, fixed=None):
    """The fastest setting of degrees ``d`` that fits, or the reason none does, with the setting that
    comes closest ("closest": plan, m, memory). ``fixed``: settings a published layout states
    ({"zero": 1, "recompute": "none", "v": 8, "micro_batch": 1}), not to be chosen."""
    fixed = fixed or {}
    recomputes = [r for r in RECOMPUTE if r in job.recompute and fixed.get("recompute", r) == r]
    best, smallest = None, None
    for b, v, m, zeros in _settings(job, d):
        if fixed.get("micro_batch", b) != b or fixed.get("v", v) != v:
            continue
        limit = len(recomputes)
        for zero in [z for z in zeros if fixed.get("zero", z) == z]:
            # more ZeRO sharding or more recomputation only costs time and saves memory: for each stage
            # the least recomputation that fits, never more than the previous stage needed
            for k, recompute in enumerate(recomputes[:limit]):
                plan = memory.Plan(d, zero, recompute, b, v, job.sp)
                term, mem, stage = fits(job, plan, m)
                total = sum(mem.values())
                if smallest is None or total < smallest[0]:
                    smallest = (total, term, mem, plan, m)
                if term:
                    continue
                t = timing.step_time(job.model, job.cluster, plan, m, eta, job.kernels, job.grad_bytes)
                if best is None or t["step"] < best["time"]["step"]:
                    best = {"plan": plan, "m": m, "time": t, "memory": mem, "memory_stage": stage}
                limit = k + 1
                break
    if best is None and smallest is None:
        return {"reason": "no micro-batch size, schedule and ZeRO stage applies to this batch", "term": None}
    if best is None:
        total, term, mem, plan, m = smallest
        return {"reason": f"{term} overflows: {total / 2**30:.1f} GiB at best (ZeRO-{plan.zero}, recompute "
                          f"{plan.recompute}, b = {plan.micro_batch}, v = {plan.v}) of {job.cluster.hbm_bytes / 2**30:.0f} GiB",
                "term": term, "memory": mem, "closest": {"plan": plan, "m": m, "memory": mem}}
    return best


def published(job, d, eta, fixed=None):
    """A published layout at its stated settings: the fastest that fits, or, when none fits by the
    planner's count, the closest one, timed all the same ({"fits": False, "reason": ...}): a
    published run did fit, so the gap is what the count leaves out."""
    row = best_for(job, d, eta, fixed)
    if "reason" not in row:
        return {"dims": d, "fits": True, **row}
    if "closest" not in row:
        return {"dims": d, "fits": False, **row}
    c = row["closest"]
    t = timing.step_time(job.model, job.cluster, c["plan"], c["m"], eta, job.kernels, job.grad_bytes)
    return {"dims": d, "fits": False, "reason": row["reason"], "term": row["term"], "plan": c["plan"],
            "m": c["m"], "time": t, "memory": c["memory"]}


def plan(job, eta):
    """Every degree tuple of ``job``: {"ranked": [rows, fastest first], "rejected": [rows]}.
    A ranked row: dims, plan, m, time, memory, rank (1 = fastest). ``eta``: the calibrated
    matmul efficiency of the cluster's GPU generation (`cases.calibrate`)."""
    job.check()
    ranked, rejected = [], []
    for d in degree_tuples(job):
        rule = broken_rule(job, d)
        if rule:
            rejected.append({"dims": d, "reason": rule, "kind": "rule"})
            continue
        best = best_for(job, d, eta)
        if "reason" in best:
            rejected.append({"dims": d, "reason": best["reason"], "kind": "memory", "term": best["term"]})
        else:
            ranked.append({"dims": d, **best})
    ranked.sort(key=lambda r: r["time"]["step"])
    for i, row in enumerate(ranked):
        row["rank"] = i + 1
    return {"job": job, "eta": eta, "ranked": ranked, "rejected": rejected}


def rank_of(result, row):
    """Where ``row`` (e.g. a `published` layout) ranks among ``result``'s layouts that fit: 1 + the
    number of other degree tuples estimated faster."""
    return 1 + sum(r["time"]["step"] < row["time"]["step"] for r in result["ranked"] if r["dims"] != row["dims"])


def find(result, dims):
    """The row of ``dims`` (a `ParallelDims`) in a `plan` result."""
    for row in result["ranked"] + result["rejected"]:
        if row["dims"] == dims:
            return row
    raise ValueError(f"no layout {dims.degrees()} for {result['job'].gpus} GPUs: its degrees do not multiply "
                     "to the GPUs.")


def tflops_per_gpu(job, row, counted="none"):
    """Estimated TFLOP/s per GPU, counting FLOPs as the paper does (`timing.model_flops_per_token`):
    ``counted`` the recomputation its count includes ("full" for Narayanan et al.'s eq. 3)."""
    per_token = timing.model_flops_per_token(job.model, counted)
    return per_token * job.batch_tokens / row["time"]["step"] / job.gpus / 1e12



def markdown_table(job, result, top=5):
    """The ``top`` fastest layouts of a `plan` result as a MyST table (the site shows it; a kernel is not needed)."""
    head = ["| rank | tp | pp | cp | ep | dp | ZeRO | recompute | b | v | m | step (s) | TFLOP/s per GPU |",
            "|---:|---:|---:|---:|---:|---:|---:|:--|---:|---:|---:|---:|---:|"]
    body = [f"| {r['rank']} | {r['dims'].tp} | {r['dims'].pp} | {r['dims'].cp} | {r['dims'].ep} | "
            f"{r['dims'].dp} | {r['plan'].zero} | {r['plan'].recompute} | {r['plan'].micro_batch} | {r['plan'].v} | "
            f"{r['m']} | {r['time']['step']:.1f} | {tflops_per_gpu(job, r):.0f} |" for r in result["ranked"][:top]]
    return "\n".join(head + body) if body else "no layout fits"


MODELS = {"70B": shapes.LLAMA2_70B, "405B": shapes.LLAMA3_405B}


def show(model="70B", gpus=64, batch_m_tokens=4, eta=0.5):
    """The planner behind widgets (JupyterLab): Llama 2 70B or Llama 3 405B on H100 nodes."""
    from IPython.display import Markdown, display
    job = Job(MODELS[model], shapes.DGX_H100, gpus, batch_m_tokens * 2 ** 20)
    display(Markdown(markdown_table(job, plan(job, eta))))


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Rank every layout of Llama 2 70B or Llama 3 405B on H100 nodes (one process; "
                   "--world-size is the number of GPUs).", None)
    for action in p._actions:  # the contract's options, as they read for a plan of GPUs
        if action.dest == "world_size":
            action.help = "number of GPUs to plan for, H100s in nodes of 8 (default 64)"
        elif action.dest == "timeout":
            action.help = "kept for the command-line contract; the planner starts no rank (default 120)"
    p.add_argument("--model", choices=sorted(MODELS), default="70B",
                   help="Llama 2 70B or Llama 3 405B (default 70B)")
    p.add_argument("--batch-tokens", type=cli.positive_int, default=4 * 2 ** 20,
                   help="tokens in one global batch (default 4,194,304: 4M)")
    p.add_argument("--eta", type=lambda t: cli.positive_float(t, 1.0), default=0.5,
                   help="matmul efficiency, above 0 and at most 1 (default 0.5; chapter 14 calibrates it "
                        "on a published row)")
    p.add_argument("--top", type=cli.positive_int, default=5,
                   help="how many of the fastest layouts to print (default 5)")
    args = cli.parse(p, argv)
    job = Job(MODELS[args.model], shapes.DGX_H100, args.world_size or 64, args.batch_tokens)
    result = plan(job, args.eta)
    rows = [{"degrees": r["dims"].degrees(), "zero": r["plan"].zero, "recompute": r["plan"].recompute,
             "micro_batch": r["plan"].micro_batch, "v": r["plan"].v, "step_s": r["time"]["step"],
             "tflops_per_gpu": tflops_per_gpu(job, r)} for r in result["ranked"][:args.top]]
    lines = [f"{i + 1}. {r['degrees']} ZeRO-{r['zero']} {r['recompute']} b={r['micro_batch']} v={r['v']}: "
             f"{r['step_s']:.2f} s, {r['tflops_per_gpu']:.0f} TFLOP/s" for i, r in enumerate(rows)]
    cli.report({"ranked": rows, "fit": len(result["ranked"]), "rejected": len(result["rejected"])}, args,
               "\n".join(lines) or "no layout fits")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
