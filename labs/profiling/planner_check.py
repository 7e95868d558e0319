"""Chapter 15, section 4: chapter 14's time model calibrated to this machine, its step-time terms
predicted for small layouts and measured from their traces, term by term, in one run.

    r = planner_check.run(steps=6)        # dp 2, tp 2, pp 2 (1F1B, 4 micro-batches), 2 ranks

In one job both ranks calibrate (`calibrate`): chapter 10's model (`alpha_beta.model`) on timed
exchanges between the two ranks (chapter 11's `latency.rank_times`): alpha the fastest exchange at the
smallest size, beta fitted with alpha held, checked before use (`check_fit`): at least the fastest
exchange at the smallest size, above half the fastest and under 1.5 times the median at every size,
within `TOP_BAND` of the fastest at the largest (measured again, up to `CALIBRATIONS` times, until it passes;
a fit that is wrong, not unlucky, fails every time). Per layout,
each rank counts one step's FLOPs (`FlopCounterMode`) and records ``steps`` steps under the
profiler, each just after timing the model's MLP matmul on its own thread (`gemm_rate`): the
FLOP/s that step is predicted with, taken at the same moment and load, both ranks at once.

`predict` is chapter 14's step (`labs.formulas.planning.timing.step`) with these constants, written out
for one small layout: compute = FLOPs / FLOP/s; a collective costs chapter 10's ring, R alpha + b n beta
(`alpha_beta.costs`), per call and byte chapter 14's traffic model predicts (`traffic`; the notebook
compares them with the calls and bytes the traces record); data parallelism's all-reduces hide under
backward as the planner's buckets do (`timing.exposed`, one bucket's fill left over) and its buffer
broadcast does not; tensor parallelism's all-reduces are all exposed (no chunked GEMMs); a pipeline's
messages are waited for, each of a rank's sends and receives priced as one message (its time in flight
spans both), and its bubble is chapter 5's (p - 1)/m of the ideal compute (`schedules.formula`, the
planner's), compared with the first stage's terms, whose window is the step. ``matmul_s``: the trace's
time in the planner's GEMM operators (`eager_traffic.MATMULS`), the part of compute its FLOP count
prices; ``comm_s``: the communication in flight, the collectives' cost before any of it is hidden."""
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from labs.collectives import alpha_beta
from labs.hardware import latency
from labs.launcher import launch
from labs.measure import timing as clock
from labs.formulas import schedules
from labs import model as tiny
from labs.formulas.planning import memory as planner_memory, shapes, timing as planner_timing
from labs.formulas.planning import traffic as traffic_model
from labs.planning import eager_traffic
from labs.profiling import analysis, intervals as iv, lab, targets, timing, trace

# name: (the chapter 15 lab that runs the layout, its options)
LAYOUTS = {"dp 2": ("ddp", {}), "tp 2": ("tp", {}), "pp 2": ("1f1b", {"microbatches": 4})}
SIZES = [4, 16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024]   # exchanges' bytes (64 KiB: 1F1B's)
GEMM = (512, 512, 128)                                 # M, N, K: the MLP's first matmul, b s = 512
TERMS = ("compute_s", "comm_s", "exposed_comm_s", "peer_wait_s", "idle_s", "step_s")
# groups whose time in flight nobody waits for: the pipeline's sends are isends, waited for only
# at the end of the step
NOT_WAITED = ("pp send",)
MATMUL_OPS = tuple("aten::" + n for n in eager_traffic.MATMULS)
CALIBRATIONS = 6        # a calibration failing its check (a burst of load) is measured again, at most 6 times
STEP_TIMINGS = 3        # GEMM timings before each step; their median prices it


def gemm_rate(a, b, reps=5):
    """FLOP/s of ``reps`` products a @ b on this rank's thread, timed together."""
    t0 = clock.now()
    for _ in range(reps):
        a @ b
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] * reps / (clock.now() - t0)


TOP_BAND = (2 / 3, 3 / 2)  # the line over the fastest exchange at the largest size, where beta rules


def check_fit(alpha, beta, fitted, fastest, median):
    """The direct check of a calibration, sizes ascending: positive constants; at the smallest size
    the line at least the fastest exchange (with `alpha_beta.model`'s alpha, the fastest exchange
    itself, and beta > 0 this holds by construction: it refuses only a free intercept that
    undershoots); at every size above half the fastest and under 1.5 times the median exchange (a
    fit far too low or far too high fails); at the largest size within `TOP_BAND` of the fastest
    exchange (a beta half or double fails there when the line meets the fastest exchange at that
    size; `beta_multiples` gives what a calibration's own check lets through). The line models the fastest
    exchanges, so nothing here bounds it from below by the median: a line far below the typical
    (median) exchange at some size passes."""
    lo, hi = TOP_BAND
    return alpha > 0 and beta > 0 and fitted[0] >= fastest[0] and all(
        f / 2 <= p <= 1.5 * t for p, f, t in zip(fitted, fastest, median)) and (
        lo * fastest[-1] <= fitted[-1] <= hi * fastest[-1])


def beta_multiples(cal, ks=tuple(k / 20 for k in range(5, 81))):
    """The smallest and largest multiple k of a calibration's beta (alpha held, k from 0.25 to 4 in
    steps of 0.05) that `check_fit` accepts on that calibration's own exchanges: how far off a beta
    the check lets through. A beta half or double is refused only where the line meets the fastest
    exchange at the largest size; a line below it there lets a larger multiple through."""
    sizes = list(cal["median_s"])
    fastest = [cal["fastest_s"][n] for n in sizes]
    median = [cal["median_s"][n] for n in sizes]
    ok = [k for k in ks if check_fit(cal["alpha"], k * cal["beta"],
                                     [cal["alpha"] + n * k * cal["beta"] for n in sizes], fastest, median)]
    return min(ok), max(ok)


def calibrate(rank, world_size, repeats=7):
    """alpha and beta between the two ranks, fitted to the fastest exchange per size of the slower
    rank and checked against the medians; the GEMM's operands for `gemm_rate`."""
    m, n, k = GEMM
    a, b = torch.randn(m, k, device=launch.device()), torch.randn(k, n, device=launch.device())
    rates = [gemm_rate(a, b) for _ in range(repeats)]
    mine = latency.rank_times(rank, world_size, SIZES, repeats)
    every = [None] * world_size
    dist.all_gather_object(every, {s: mine[f"exchange/barrier/{s}"] for s in SIZES})
    slowest = {s: [max(r[s][i] for r in every) for i in range(repeats)] for s in SIZES}
    # chapter 10's model: alpha the fastest exchange at the smallest size, beta fitted with it held
    fit = alpha_beta.model(SIZES, [slowest[s] for s in SIZES])
    predicted = [fit["alpha"] + n * fit["beta"] for n in SIZES]
    median = [statistics.median(slowest[s]) for s in SIZES]
    fastest = [min(slowest[s]) for s in SIZES]
    ok = check_fit(fit["alpha"], fit["beta"], predicted, fastest, median)
    return {"flops": statistics.median(rates), "flops_spread": (min(rates), max(rates)),
            "threads": torch.get_num_threads(), "alpha": fit["alpha"], "beta": fit["beta"],
            "intercept": fit["intercept"], "median_s": dict(zip(SIZES, median)),
            "fastest_s": dict(zip(SIZES, fastest)), "fitted_s": dict(zip(SIZES, predicted)),
            "checked": ok, "operands": (a, b)}


@launch.on_cpu("it calibrates the planner to one CPU thread's matmuls and gloo's alpha and beta between "
               "two processes; a GPU box's constants are chapter 14's eta and NCCL's alpha, not these")
def rank_run(rank, world_size, layouts, folder, steps=6, warmup=1):
    """One rank: calibrate, then per layout count one step's FLOPs and record ``steps`` steps, each
    just after timing the GEMM again, the median of `STEP_TIMINGS` timings (the FLOP/s that step's
    prediction uses: same moment, same load)."""
    for attempt in range(1, CALIBRATIONS + 1):   # both ranks decide alike: the check reads the same data
        cal = calibrate(rank, world_size)
        if cal["checked"]:
            break
    cal["attempts"] = attempt
    a, b = cal.pop("operands")
    out = []
    for name in layouts:
        which, options = LAYOUTS[name]
        step = targets.build(which, rank, world_size, **options)
        with FlopCounterMode(display=False) as counter:
            step()
        for _ in range(warmup):
            step()
        rates = []
        with trace.Recorder(f"{folder}/{name.replace(' ', '')}", rank, memory=False, gz=False) as rec:
            for i in range(steps):
                # the median of a few timings: one timing alone can catch a cold cache or the
                # profiler's own start, and then prices the whole step at that moment's rate
                rates.append(statistics.median(gemm_rate(a, b) for _ in range(STEP_TIMINGS)))
                dist.barrier()
                with rec.step(i):
                    step()
        dist.barrier()
        out.append({"rank": rank, "path": rec.path, "wall_s": rec.steps, "threads": rec.threads,
                    "trace": trace.load(rec.path), "flops": counter.get_total_flops(), "rates": rates})
    return {"calibration": cal, "layouts": out}


def matmul_seconds(t):
    """Per step of one trace: the seconds the rank thread spent in the planner's GEMM operators."""
    windows, tid = analysis.steps(t["events"])
    mm = iv.union((e["ts"], e["ts"] + e["dur"]) for e in t["events"]
                  if e["tid"] == tid and e["name"] in MATMUL_OPS)
    return [iv.length(iv.clip(mm, (a, b))) / 1e6 for _, a, b in windows]


def collective_s(op, calls, nbytes, cal, p=2):
    """Chapter 10's time of ``calls`` calls moving ``nbytes`` in all: R alpha per call + b n beta."""
    rounds, per_byte = alpha_beta.costs(p)["ring"] if op == "all_reduce" else (1, 1.0)
    return calls * rounds * cal["alpha"] + per_byte * nbytes * cal["beta"]


def traffic(name, world_size=2, batch_size=8):
    """Calls and bytes per step of one rank of ``name``, predicted by chapter 14's traffic model
    (`labs.formulas.planning.traffic`) on the layout's model shape, in `analysis.comm_by_op`'s form
    ({"gloo:op": {"calls", "bytes"}}, the bytes of the tensors passed): dp, one all-reduce of the
    parameters in buckets of `targets.BUCKET_BYTES` (the planner's buckets) and DDP's broadcast of
    the model's buffers (no term in the traffic model: the model's own); tp, `traffic.layer_calls`
    per layer (no vocabulary parallelism); pp, `traffic.pp_sends` of `traffic.pp_send_bytes` per
    micro-batch and as many receives, each message with the hand executor's clock, one fp32, appended
    (`labs/pipeline/executor.py`)."""
    _, opts = LAYOUTS[name]
    if name.startswith("pp"):
        cfg, m = targets.config(n_layer=8), opts["microbatches"]
        shape = shapes.from_gpt_config(cfg)
        size = traffic_model.pp_send_bytes(shape, 1, 1, max(1, batch_size // m), cfg.seq_len, 4) + 4
        n = m * traffic_model.pp_sends(0, world_size, 1)
        return {"gloo:send": {"calls": n, "bytes": n * size}, "gloo:recv": {"calls": n, "bytes": n * size}}
    cfg = targets.config()
    shape = shapes.from_gpt_config(cfg)
    if name.startswith("tp"):
        calls = traffic_model.layer_calls(shape, world_size, 1, 1, batch_size, cfg.seq_len, 4, "none", 0,
                                          sp=False)
        return {f"gloo:{op}": {"calls": n * cfg.n_layer, "bytes": n * cfg.n_layer * payload}
                for _, op, payload, n in calls}
    grads = 4 * sum(planner_memory.stage_params(shape, 1, 1, 1, 1, 0))
    buffers = 4 * sum(b.numel() for b in tiny.build(cfg, device="meta").buffers())
    return {"gloo:all_reduce": {"calls": -(-grads // targets.BUCKET_BYTES), "bytes": grads},
            "gloo:broadcast": {"calls": 1, "bytes": buffers}}


def predict(name, flops, comm, cal, world_size=2):
    """The planner's terms for one rank of ``name``: compute, exposed communication by group,
    bubble, in seconds; ``comm``: calls and bytes per step (`traffic`'s, or a trace's
    `analysis.comm_by_op`)."""
    def cost(op):
        c = comm.get(f"gloo:{op}") or comm.get(f"nccl:{op}") or {"calls": 0, "bytes": 0}
        return collective_s(op, c["calls"], c["bytes"], cal, world_size)
    compute = flops / cal["flops"]
    out = {"compute_s": compute, "exposed_comm_s": 0.0, "peer_wait_s": 0.0, "groups": {}}
    if name.startswith("dp"):
        calls = (comm.get("gloo:all_reduce") or {"calls": 1})["calls"]
        hidden = float(planner_timing.exposed(cost("all_reduce"), 2 / 3 * compute, max(calls, 1)))
        out["groups"] = {"dp all-reduce": hidden, "dp broadcast": cost("broadcast")}
    elif name.startswith("tp"):
        out["groups"] = {"tp all-reduce": cost("all_reduce")}
    else:
        # like with like: the rank's time in flight spans its sends and its receives, but the
        # executor waits on its isends only at the step's end, when every receive is posted, so
        # only the receives are waited for (the trace reader books a send's wait only where the
        # rank waits on it before its receive is posted)
        out["groups"] = {"pp send": cost("send"), "pp recv": cost("recv")}
        _, opts = LAYOUTS[name]
        bubble = schedules.formula("1f1b", world_size, opts["microbatches"])["over_ideal"]
        out["peer_wait_s"] = bubble * compute
    out["exposed_comm_s"] = sum(v for g, v in out["groups"].items() if g not in NOT_WAITED)
    out["comm_s"] = sum(out["groups"].values()) + (cost("all_reduce") - out["groups"]["dp all-reduce"]
                                                   if name.startswith("dp") else 0.0)
    out["step_s"] = out["compute_s"] + out["exposed_comm_s"] + out["peer_wait_s"]
    return out


def step_rates(results):
    """The FLOP/s that prices each step: the median over the ranks of the rate each timed just before
    that step (not the calibration's, timed before the runs)."""
    return [statistics.median(r["rates"][i] for r in results) for i in range(len(results[0]["rates"]))]


def compare(name, results, cal):
    """Predicted beside measured, per term: each step's measured term (the mean over the ranks; a
    pipeline's first stage alone) over that step's prediction (the FLOP/s timed just before it, the
    median of the ranks'), their median and its distribution-free interval over the steps (`timing`)."""
    s = lab.summarize(results)
    model_comm = traffic(name)            # predicted by the traffic model, compared with the trace below
    rates = step_rates(results)
    # A pipeline's terms are the first stage's: it starts the step and runs its last backward, so its
    # window is the pipeline's step, which chapter 5's bubble describes; the last stage's window ends
    # at its own optimizer step, before the first stage's last backward, and holds less of the bubble.
    used = [0] if name.startswith("pp") else list(range(len(results)))
    per_rank = [s["per_rank"][i] for i in used]
    chosen = [results[i] for i in used]
    n = len(per_rank[0])
    mean = {k: [sum(rows[i][k] for rows in per_rank) / len(per_rank) for i in range(n)] for k in TERMS}
    mm = [matmul_seconds(r["trace"]) for r in chosen]
    mean["matmul_s"] = [sum(x[i] for x in mm) / len(mm) for i in range(n)]
    keys = ("compute_s", "comm_s", "exposed_comm_s", "peer_wait_s", "step_s")
    pred = {k: [] for k in keys}
    for i, rate in enumerate(rates):
        preds = [predict(name, r["flops"], model_comm, dict(cal, flops=rate)) for r in chosen]
        for k in keys:
            pred[k].append(sum(p[k] for p in preds) / len(preds))
    pred["matmul_s"] = pred["compute_s"]
    groups = {g: sum(p["groups"][g] for p in preds) / len(preds) for g in preds[0]["groups"]}
    if any(pred["peer_wait_s"]):    # the bubble as a share of compute: (p - 1)/m, whatever the rate
        mean["bubble_share"] = [w / c for w, c in zip(mean["peer_wait_s"], mean["compute_s"])]
        pred["bubble_share"] = [w / c for w, c in zip(pred["peer_wait_s"], pred["compute_s"])]
        # a receive is peer wait until the peer posts its send, communication after: both are waiting
        mean["wait_share"] = [(w + x) / c for w, x, c in zip(mean["peer_wait_s"], mean["exposed_comm_s"],
                                                             mean["compute_s"])]
        pred["wait_share"] = [(w + x) / c for w, x, c in zip(pred["peer_wait_s"], pred["exposed_comm_s"],
                                                             pred["compute_s"])]
    rows = {}
    for k, values in mean.items():
        med, lo, hi, conf = timing.median_interval(values)
        p = pred.get(k)
        r = timing.median_interval([v / q for v, q in zip(values, p)]) if p and all(p) else (None,) * 4
        rows[k] = {"measured_s": med, "low_s": lo, "high_s": hi,
                   "predicted_s": statistics.median(p) if p else None,
                   "ratio": r[0], "ratio_low": r[1], "ratio_high": r[2], "confidence": r[3] or conf}
    return {"layout": name, "lab": LAYOUTS[name][0], "terms": rows, "groups": groups,
            "traffic": {"model": model_comm, "trace": [rk["comm_by_op"] for rk in s["ranks"]]},
            "flops": [r["flops"] for r in results], "rates": rates, "steps": n, "per_rank": s["per_rank"],
            "ranks": used, "paths": [r["path"] for r in results]}


def run(layouts=tuple(LAYOUTS), steps=6, warmup=1, folder=None, timeout=600):
    """Spawn 2 ranks (gloo, on the CPU on every machine) once for all ``layouts``; per layout,
    `compare`'s rows, and the job's calibration (the FLOP/s: the median of the two ranks')."""
    for name in layouts:
        if name not in LAYOUTS:
            raise ValueError(f"unknown layout {name!r}; choose from {', '.join(LAYOUTS)}.")
    if steps < 6:
        raise ValueError(f"an interval of the median at 95% needs at least 6 steps, got {steps}.")
    folder = os.path.abspath(folder or tempfile.mkdtemp(prefix="labs-planner-check-"))
    res = launch.launch(rank_run, 2, list(layouts), folder, steps, warmup, timeout=timeout)
    if res is None:
        return None
    cal = dict(res[0]["calibration"], flops=statistics.median(r["calibration"]["flops"] for r in res))
    return {"calibration": cal, "oversubscribed": 2 > (os.cpu_count() or 1),
            "layouts": {name: compare(name, [r["layouts"][i] for r in res], cal)
                        for i, name in enumerate(layouts)}}
