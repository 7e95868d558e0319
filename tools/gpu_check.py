"""`make gpu-check`: everything a lent GPU should run, in one command of at most 8 minutes.

A lent GPU comes with minutes, not hours: this runs, with the box's own Python and torch and nothing
to install, each part in its own process group under its own time limit (a part past its limit is
killed, reported, and the next one starts), prints how long each took, and writes what each found
to results/gpu/ with the provenance (GPU, driver, CUDA, torch, Python, commit, date):

  provenance  the device and the software, from this process                       (15 s)
  fp8         chapter 8's FP8 kernel probe on the GPU, each recipe's gap to the
              emulation beside the bound derived for Hopper's accumulation          (45 s)
  smoke       the chapters' labs at world size 1, where the launcher picks NCCL:
              the device placement the CPU audit checks, on a real GPU             (75 s)
  record      python -m labs.gpu: every figure the book quotes for a GPU; the file
              is rewritten after each section, so a run cut short keeps what ran   (180 s)
  tests       the tests of what differs on a box: the launcher and backend choice,
              torch 2.11's API, the GPU command, FP8, the device audit              (90 s)
  ch15        chapter 15's OPT-1.3B exercise (DDP, FSDP2, FSDP2 + checkpointing) at
              full size on one rank, where labs/profiling/opt_exercise.py exists   (75 s)

The limits add up to 480 s. The whole test suite (about 20 minutes on 2 cores, and every test
runs on gloo whatever the machine) and the notebooks (`make box-test`) do not fit; the tests
chosen are those whose outcome depends on the box's torch or on its GPU. Results:
results/gpu/<device>.json (labs.gpu) and results/gpu/<device>-check.json (the rest).

    python tools/gpu_check.py             on a GPU box
    python tools/gpu_check.py --plan      the parts, their commands and limits; runs nothing
    python tools/gpu_check.py --dry-run   the CPU-side parts on this machine, into a temporary folder
"""
import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BUDGET_S = 480
TESTS = ["tests/test_box.py", "tests/test_gpu.py", "tests/test_torch_compat.py", "tests/test_launch.py",
         "tests/test_fp8.py", "tests/test_devices.py"]
_PROBE = ("import json; from labs.precision import kernels; "
          "print(json.dumps(kernels.try_kernels(device={device!r})))")


def parts(dry_run=False):
    """[(name, command, limit in seconds, what it writes: "json" from stdout or "file")]."""
    py = sys.executable
    ch15 = os.path.exists(os.path.join(ROOT, "labs", "profiling", "opt_exercise.py"))
    out = [("provenance", None, 15, None),
           ("fp8", [py, "-c", _PROBE.format(device="cpu" if dry_run else None)], 45, "json"),
           ("smoke", [py, "-m", "labs.gpu.smoke", "--json", "--timeout", "70"], 75, "json"),
           ("record", [py, "-m", "labs.gpu"] + (["--dry-run", "--only", "bandwidth"] if dry_run else []), 180,
            "json" if dry_run else "file"),
           ("tests", [py, "-m", "pytest", *TESTS, "-q", "-x", "-p", "no:cacheprovider"]
            + (["-n", "8"] if importlib.util.find_spec("xdist") else []), 90, None),
           ("ch15", [py, "-m", "labs.profiling.opt_exercise", "--world-size", "1", "--steps", "1", "--json"]
            + (["--scale", "32"] if dry_run else []) if ch15 else None, 75, "json")]
    if dry_run:   # the dry run checks the runner, not the suite: it never starts the tests it belongs to
        out = [p for p in out if p[0] != "tests"]
    return out


def run_part(cmd, limit, env=None):
    """Run ``cmd`` in its own process group; past ``limit`` seconds kill the group. Returns
    (status "ok" / "failed (exit N)" / "timed out after N s", seconds, stdout, stderr's tail)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        status = f"timed out after {limit} s"
    return status, round(time.monotonic() - start, 1), out, err[-3000:]


def _last_json(text):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    try:
        return json.loads(text)
    except ValueError:
        return None


def provenance(argv):
    import torch
    from labs.gpu import record
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    p = record.provenance([], device)
    p["command"] = " ".join(["python", "tools/gpu_check.py", *argv])
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", action="store_true", help="print the parts, commands and limits; run nothing")
    ap.add_argument("--dry-run", action="store_true",
                    help="the CPU-side parts here, results to a temporary folder")
    ap.add_argument("--out",
                    help="folder for the results (default results/gpu, or a temporary one with --dry-run)")
    args = ap.parse_args(argv)
    plan = parts(args.dry_run)
    if args.plan:
        for name, cmd, limit, _ in plan:
            what = (" ".join(cmd) if cmd else "(this process)" if name == "provenance"
                    else "(skipped: no labs.profiling)")
            print(f"{name:10s} {limit:4d} s  {what}")
        print(f"{'total':10s} {sum(p[2] for p in plan):4d} s of at most {BUDGET_S} s")
        return 0
    import torch
    from labs.gpu import record
    if not args.dry_run and not torch.cuda.is_available():
        print("error: make gpu-check measures a GPU and this machine has no CUDA device; run it on a GPU "
              "box, or pass --dry-run to check its CPU-side parts here.", file=sys.stderr)
        return 2
    out_dir = args.out or (tempfile.mkdtemp(prefix="gpu-check-") if args.dry_run else record.RESULTS)
    os.makedirs(out_dir, exist_ok=True)
    from labs.launcher import torchrun
    # the labs of this checkout, the box's packages kept
    env = torchrun.child_env(ROOT, PYTHONUNBUFFERED="1")
    report = {"provenance": None, "budget_s": BUDGET_S, "dry_run": args.dry_run, "parts": {}}
    total = time.monotonic()
    for name, cmd, limit, kind in plan:
        start = time.monotonic()
        if name == "provenance":
            report["provenance"] = provenance(argv)
            part = {"status": "ok", "seconds": round(time.monotonic() - start, 1)}
        elif cmd is None:
            part = {"status": "skipped: labs/profiling/opt_exercise.py is not in this checkout",
                    "seconds": 0.0}
        else:
            status, seconds, out, err = run_part(cmd, limit, env)
            part = {"status": status, "seconds": seconds, "command": " ".join(["python", *cmd[1:]])}
            if kind == "json":
                part["result"] = _last_json(out)
            if status != "ok":
                part["stderr_tail"] = err
        part["limit_s"] = limit
        report["parts"][name] = part
        print(f"[gpu-check] {name:10s} {part['status']:28s} {part['seconds']:6.1f} s of {limit} s",
              flush=True)
        slug = record.device_slug(report["provenance"]["device"])
        with open(os.path.join(out_dir, f"{slug}-check.json"), "w") as f:   # after every part: nothing lost
            json.dump(report, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
    print(f"[gpu-check] total {time.monotonic() - total:.1f} s; results in {out_dir}", flush=True)
    ok = all(p["status"] == "ok" or p["status"].startswith("skipped") for p in report["parts"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
