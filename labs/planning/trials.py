"""Chapter 14: two inputs the model takes without fitting, varied, each in a fresh process so that no
price cached under the model's own settings leaks into the trial.

- ``dense``: the grouped GEMM's per-tile cost on every dense GEMM too (`kernels.DENSE_K0`, K_0 solved
  from DeepGEMM's dense FP8 rows, half in BF16), judged on the whole checked set like the model;
- ``grouped0``: the experts' grouped-GEMM shape term off (`kernels.GROUPED_K0` = 0): how many GPUs
  the firsts of the three 64-GPU MoE jobs spread their experts over;
- ``ring``: tensor and context parallelism's overlaps priced as rings that start on the rank's own chunk,
  with no fill (`timing.TP_CP_FILL`), the efficiencies refitted: the checked set's score, the first layout
  for 70B on 64 H100s at 4K and the plan by hand's place, as for ``sigma0``;
- ``sigma0``: sigma on NVLink, Calculon's ``processor_usage`` (`timing.PROCESSOR_USAGE`), set to 0 with
  the efficiencies refitted: which layout comes first for 70B on 64 H100s at 4K, and where the plan
  by hand (TP 8 x DP 8, ZeRO-2, micro-batches of 4) ranks.

    python -m labs.planning.trials --json
"""
import argparse
import json
import os
import subprocess
import sys

TRIALS = ("dense", "sigma0", "grouped0", "ring")
DENSE_K0_FP8 = 797.0        # DeepGEMM's dense FP8 rows at a6d97a1c ("Normal GEMMs for dense models")


def layout_words(dims):
    """"TP 4 × PP 2 × DP 8": the degrees above 1, in the chapter's order."""
    axes = [a for a in ("tp", "pp", "cp", "dp") if getattr(dims, a) > 1]
    return " × ".join(f"{a.upper()} {getattr(dims, a)}" for a in axes)


def one(which):
    """Run one trial in this process (call it in a fresh one: `run`)."""
    from labs.dims import ParallelDims
    from labs.formulas.planning import kernels, planner, shapes, timing
    from labs.planning import checked, scorecard
    if which == "grouped0":
        from labs.planning import published_tables
        kernels.GROUPED_K0 = 0.0
        h100 = checked.calibration()["H100", "bf16"][0]
        return {key: planner.plan(planner.Job(published_tables.MODEL_SHAPES[key], shapes.DGX_H100, 64,
                                              4 * 2**20), h100)["ranked"][0]["dims"].ep
                for key in ("qwen3-235b", "qwen3-30b", "mixtral-8x7b")}
    if which == "dense":
        kernels.DENSE_K0 = DENSE_K0_FP8
        s = scorecard.summary(checked.evaluate_all(table=checked.calibration()))
        return {"within15": s["within15"], "predictions": s["predictions"], "mae": s["mae"]}
    out = {}
    if which == "ring":
        timing.TP_CP_FILL = "ring"
        table = checked.calibration()
        s = scorecard.summary(checked.evaluate_all(table=table))
        out = {"within15": s["within15"], "predictions": s["predictions"], "mae": s["mae"]}
    else:
        timing.PROCESSOR_USAGE["node"] = 0.0
    h100 = checked.calibration()["H100", "bf16"][0]
    job = planner.Job(shapes.LLAMA2_70B, shapes.DGX_H100, 64, 4 * 2**20)
    res = planner.plan(job, h100)
    hand = planner.published(job, ParallelDims(tp=8, dp=8), h100,
                             {"zero": 2, "recompute": "none", "micro_batch": 4})
    first = res["ranked"][0]
    return {**out, "first": layout_words(first["dims"]),
            "first_settings": f"ZeRO-{first['plan'].zero}, b = {first['plan'].micro_batch}"
                              + (f", v = {first['plan'].v}" if first["dims"].pp > 1 else ""),
            "hand_rank": planner.rank_of(res, hand), "of": len(res["ranked"]),
            "hand_gap": hand["time"]["step"] / first["time"]["step"] - 1}


def run(which, timeout=600):
    """`one` in a fresh interpreter, its result read back."""
    if which not in TRIALS:
        raise ValueError(f"unknown trial {which!r}; choose from {', '.join(TRIALS)}.")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "labs.planning.trials", "--one", which], env=env,
                         capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.stdout)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", choices=TRIALS, help="run one trial here, in this process")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    out = one(a.one) if a.one else {w: run(w) for w in TRIALS}
    print(json.dumps(out) if a.json or a.one else out)


if __name__ == "__main__":
    main()
