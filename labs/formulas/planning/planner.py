"""Chapter 14: the planner. Every layout of a job, the rules each breaks, what does not fit, and a ranking.

A job is a model (chapter 1's `ModelShape`), a cluster (`shapes.Cluster`), a number of GPUs, a global
batch in tokens, the training stack that runs it (`software.Software`: what it offers, what it
overlaps) and the precision of its matmuls. The planner enumerates the degrees tp x pp x cp x ep x dp
(HSDP's dp_replicate where the stack has it) that multiply to the GPUs, each a
`labs.dims.ParallelDims`, and for each every ZeRO stage, recomputation, micro-batch size b, schedule
and virtual stages v the stack offers (`search`). A layout is refused for the first rule it breaks:

- tensor parallelism beyond a node (chapters 4 and 11: its all-reduces would cross the network);
- heads that tp does not divide (chapter 4's `kv_layout`), or experts that ep does not;
- a global batch that does not split into dp x b sequences per micro-batch, or an interleaved
  schedule whose m is not a multiple of p (chapter 5's `schedules.interleaved`);
- context parallelism with attention scores written out (chapter 6's methods attend block by block),
  or a sequence that does not split into 2 cp chunks (chapter 6's zig-zag order);
- layers that do not split evenly over the pipeline's stages, on a stack that splits them evenly
  (Megatron-LM; `software.Software.uniform_stages`);

and otherwise for the first memory term whose count overflows the GPU (`memory.terms` against the
HBM), or, offloaded, the host. The published runs that ran reach the GPU's last GiB by the same count
(chapter 14), so no reserve is held back: `shapes.RESERVE` is an assumption reported beside the count,
not a limit. The layouts that fit are ranked by `timing.step`; each degree tuple is shown at its
fastest setting of the other knobs, so "rank" is among degree tuples, and only a row that fits has one
(`rank_of`).
"""
from dataclasses import dataclass


from labs.dims import ParallelDims
from labs.formulas.shape import ModelShape
from labs.formulas.planning import search, shapes, software as stacks, timing
from labs.formulas.tensor_parallel import kv_layout

PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class Job:
    model: ModelShape
    cluster: shapes.Cluster
    gpus: int
    batch_tokens: int
    software: stacks.Software = stacks.ANY
    precision: str = "bf16"   # the matmuls' precision: "fp8" runs them at the FP8 peak (its own eta)
    eager: bool = False       # elementwise ops one by one (no torch.compile, no fused kernels): `kernels`

    @property
    def sequences(self):
        return self.batch_tokens // self.model.seq

    @property
    def kernels(self):
        return self.software.kernels

    @property
    def recipe(self):
        return self.software.recipe

    @property
    def fp8(self):
        return self.precision == "fp8"

    def check(self):
        """One sentence for the first input that cannot be planned, before anything is computed."""
        for name in ("gpus", "batch_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive whole number, got {value!r}: "
                                 + ("a job runs on at least one GPU." if name == "gpus" else
                                    f"a batch holds at least one {self.model.seq:,}-token sequence."))
        if self.batch_tokens % self.model.seq:
            raise ValueError(f"a batch of {self.batch_tokens:,} tokens is not a whole number of "
                             f"{self.model.seq:,}-token "
                             f"sequences; give a multiple of the sequence length.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}.")
        if self.fp8 and not self.cluster.fp8_flops:
            raise ValueError(f"precision 'fp8' needs FP8 tensor cores, and {self.cluster.name} has none.")
        for name in ("hbm_bytes", "intra_bw", "inter_bw", "peak_flops", "hbm_bw"):
            value = getattr(self.cluster, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{self.cluster.name}: {name} must be a positive number, got {value!r}: "
                                 "every link, peak and memory of a GPU the planner prices is above zero.")
        if self.software.kernels not in ("materialized", "flash", "fused"):
            raise ValueError(f"kernels must be materialized, flash or fused, got {self.software.kernels!r}.")


def check_eta(eta):
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 < eta <= 1:
        raise ValueError(f"eta must be a fraction of the peak above 0 and at most 1, got {eta!r}: it is the "
                         "share "
                         "of the peak the matmuls reach (`checked.calibrate` fits it).")


def degree_tuples(job):
    """Every `ParallelDims` whose tp pp cp dp is the GPUs (ep divides dp, or tp cp dp where the stack folds
    its experts, `ParallelDims.fold_ep`; HSDP's replicas where offered)."""
    m, n, sw = job.model, job.gpus, job.software
    for tp in [t for t in (1, 2, 4, 8, 16, 32, 64) if n % t == 0 and t <= sw.max_tp]:
        for pp in [p for p in range(1, min(n // tp, m.layers, sw.max_pp) + 1) if (n // tp) % p == 0]:
            for cp in [c for c in (1, 2, 4, 8, 16, 32) if (n // (tp * pp)) % c == 0 and c <= sw.max_cp]:
                dp = n // (tp * pp * cp)
                spread = tp * cp * dp if sw.ep_folding else dp
                for ep in ([e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256)
                            if spread % e == 0 and e <= m.experts] if m.moe else [1]):
                    yield ParallelDims(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, fold_ep=sw.folds(ep))
                    if sw.hsdp and ep == 1 and 3 in sw.zero_stages:
                        for shard in (8, 16, 32, 64):
                            if shard < dp and dp % shard == 0:
                                yield ParallelDims(tp=tp, pp=pp, cp=cp, dp=dp, dp_replicate=dp // shard)


def broken_rule(job, d):
    """The first rule the degrees ``d`` break, in one sentence; None if they break none."""
    m, c = job.model, job.cluster
    if d.tp > c.gpus_per_node:
        return f"tp = {d.tp} reaches beyond a node of {c.gpus_per_node} GPUs"
    try:
        kv_layout(m.heads, m.kv_heads, d.tp)
    except ValueError as exc:
        return str(exc).rstrip(".")
    # Megatron-Core's TransformerConfig, core_r0.8.0 to r0.15.0: tp must divide the KV heads
    if m.kv_heads % d.tp:
        return (f"tp = {d.tp} does not divide the {m.kv_heads} KV heads, which the training stacks "
                f"require (copying them is chapter 4's lab layout, not a stack's)")
    if job.sequences % d.dp:
        return f"the batch of {job.sequences:,} sequences does not split over dp = {d.dp}"
    if job.software.uniform_stages and m.layers % d.pp:
        return (f"{job.software.name} splits the layers evenly, and {m.layers} layers do not split over "
                f"pp = {d.pp}")
    if d.cp > 1 and job.kernels == "materialized":   # chapter 6's methods attend block by block
        return "context parallelism needs a fused attention kernel, not scores written out"
    if d.cp > 1 and m.seq % (2 * d.cp):
        return f"the sequence of {m.seq:,} tokens does not split into 2 cp = {2 * d.cp} chunks"
    if m.moe and m.experts % d.ep:
        return f"{m.experts} experts do not split over ep = {d.ep}"
    return None


def plan(job, eta):
    """Every degree tuple of ``job``: {"ranked": [rows, fastest first], "rejected": [rows]}.
    A ranked row: dims, plan, m, time, memory, rank (1 = fastest). ``eta``: the calibrated
    matmul efficiency of the cluster's generation and the job's precision (`checked.calibrate`)."""
    job.check()
    check_eta(eta)
    ranked, rejected, open_ = [], [], []
    for d in degree_tuples(job):
        rule = broken_rule(job, d)
        if rule:
            rejected.append({"dims": d, "reason": rule, "kind": "rule"})
        else:
            open_.append(d)
    for row in search.best_per_layout(job, eta, open_):
        if "reason" in row:
            rejected.append({**row, "kind": "memory"})
        else:
            ranked.append(row)
    ranked.sort(key=lambda r: r["time"]["step"])
    for i, row in enumerate(ranked):
        row["rank"] = i + 1
    return {"job": job, "eta": eta, "ranked": ranked, "rejected": rejected}


def published(job, d, eta, fixed=None):
    """A published layout at its stated settings (``fixed``: {"zero", "recompute", "v", "micro_batch",
    "offload"}): the fastest that fits, or, when none fits by the planner's count, the closest one,
    timed all the same ({"fits": False, "reason": ...}): a published run did fit, so the gap is what
    the count leaves out."""
    job.check()
    check_eta(eta)
    rule = broken_rule(job, d)
    if rule:
        raise ValueError(f"the published layout {d} breaks a rule: {rule}.")
    (row,) = search.best_per_layout(job, eta, [d], fixed or {}, closest=True)
    return {"dims": d, "fits": "reason" not in row, **row}


def rank_of(result, row):
    """Where ``row`` (e.g. a `published` layout) ranks among ``result``'s layouts that fit: 1 + the
    number of other degree tuples estimated faster. A row the planner would refuse has no rank: its
    layout must break no rule (`broken_rule`) and its own count, at its settings, must fit the GPU (and
    the host, offloaded): the test the ranked layouts pass."""
    job = result["job"]
    if not result["ranked"]:
        raise ValueError(f"no layout of {job.model.name} on {job.gpus:,} GPUs fits, so {row['dims']} has no "
                         "rank among them.")
    rule = broken_rule(job, row["dims"])
    if rule:
        raise ValueError(f"{row['dims']} breaks a rule ({rule}), so it has no rank.")
    total = sum(row["memory"].values())
    if row.get("fits") is False or total > job.cluster.hbm_bytes:
        raise ValueError(f"{row['dims']} at these settings counts {total / 2 ** 30:.1f} GiB, over the GPU's "
                         f"{job.cluster.hbm_bytes / 2 ** 30:.2f} GiB: refused, so it has no rank.")
    return 1 + sum(r["time"]["step"] < row["time"]["step"] for r in result["ranked"]
                   if r["dims"] != row["dims"])


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


def hsdp(d):
    """" (HSDP r x s)": HSDP's replicas and shard group of layout ``d``, or "" when dp is not split."""
    return f" (HSDP {d.dp_replicate} x {d.dp // d.dp_replicate})" if d.dp_replicate > 1 else ""


def markdown_table(job, result, top=5):
    """The ``top`` fastest layouts of a `plan` result as a MyST table (the site shows it; a kernel is not
    needed)."""
    head = ["| rank | tp | pp | cp | ep | dp | ZeRO | recompute | b | v | m | step (s) | TFLOP/s per GPU |",
            "|---:|---:|---:|---:|---:|---:|---:|:--|---:|---:|---:|---:|---:|"]
    body = [f"| {r['rank']} | {r['dims'].tp} | {r['dims'].pp} | {r['dims'].cp} | {r['dims'].ep} | "
            f"{r['dims'].dp}{hsdp(r['dims'])} | {r['plan'].zero} | "
            f"{r['plan'].recompute} | {r['plan'].micro_batch} | {r['plan'].v} | {r['m']} | "
            f"{r['time']['step']:.1f} | "
            f"{tflops_per_gpu(job, r):.0f} |" for r in result["ranked"][:top]]
    return "\n".join(head + body) if body else "no layout fits"
