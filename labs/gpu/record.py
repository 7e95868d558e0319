"""The GPU figures of the book, recorded by one command (issue 19, part 2).

    python -m labs.gpu             on a CUDA machine: every section, results/gpu/<device>.json
    python -m labs.gpu --dry-run   anywhere: every section at tiny sizes, JSON on stdout, no file

Each figure is a dict of value, unit, kind and formula, or a "skipped:"/"refused:" reason, never
a made-up number (`labs.gpu.figures`). The sections (what they measure, against which formula) live in
`labs.gpu.memory` (chapter 1: saved-for-backward bytes, the Adam step's bytes per parameter),
`labs.gpu.speed` (matmul TFLOP/s, MFU, FP8, recomputation, copy bandwidth) and `labs.gpu.dcp`
(chapter 12: the checkpoint pause). A results file is only ever written from a GPU run.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch

from labs.gpu import dcp, memory, speed
from labs.launcher import cli
from labs.measure import timing

# this file is labs/<package>/<file>.py: three levels up is the repository
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "results", "gpu")
REFUSAL = ("python -m labs.gpu measures a GPU and this machine has no CUDA device; "
           "run it on a GPU box, or pass --dry-run to check every section on the CPU at tiny sizes.")


@dataclass
class Sizes:
    """Every size and repeat count, GPU and dry run: one place to budget the 10 minutes."""
    act_seqs: tuple = (2048, 4096)          # s for the saved-bytes rows
    act_hiddens: tuple = (2048, 4096)       # h; heads a = h / head_dim
    head_dim: int = 128
    model_layers: int = 12                  # the ~200M GPT (labs.model shapes)
    model_hidden: int = 1024
    model_heads: int = 16
    model_vocab: int = 32768
    model_seq: int = 1024
    model_batch: int = 8
    big_matmul: int = 8192                  # n for the n^3 bf16 and FP8 matmuls
    fp8_error_shape: tuple = (1024, 4096, 1024)   # M, K, N (multiples of 128 for the blocks)
    matmul_repeats: int = 20
    step_repeats: int = 10
    recompute: tuple = (4, 2048, 16, 2048, 2)     # layers, hidden, heads, seq, batch
    recompute_repeats: int = 5
    copy_bytes: int = 1 << 30               # device-to-device
    host_bytes: int = 256 << 20             # host <-> device
    copy_repeats: int = 10


DRY = Sizes(act_seqs=(16, 32), act_hiddens=(32, 64), head_dim=8, model_layers=2, model_hidden=32,
            model_heads=4, model_vocab=64, model_seq=16, model_batch=2, big_matmul=256,
            fp8_error_shape=(128, 256, 128), matmul_repeats=2, step_repeats=2,
            recompute=(4, 32, 4, 16, 2), recompute_repeats=2, copy_bytes=1 << 16,
            host_bytes=1 << 16, copy_repeats=2)


def _run(cmd):
    try:
        return (subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT).stdout.strip()
                or None)
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(argv, device):
    """Where and how the figures were taken: device, driver, CUDA, torch, Python, date, commit, command."""
    cuda = device.type == "cuda"
    return {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "driver": (_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if cuda
                       else None),
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            # a copy of the tree without .git (a lent box's) names its commit in LABS_GIT_COMMIT
            "git_commit": _run(["git", "rev-parse", "HEAD"]) or os.environ.get("LABS_GIT_COMMIT"),
            "git_dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])),
            "command": " ".join(["python", "-m", "labs.gpu", *argv])}


def device_slug(name):
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def sections():
    """Name -> function(device, sizes) -> dict, in the order they run."""
    return {"activations": memory.saved_bytes, "adam_step_memory": memory.adam_step_memory,
            "matmul": speed.matmul_tflops, "mfu": speed.step_mfu, "fp8": speed.fp8_matmul,
            "recompute": speed.recompute_overhead, "bandwidth": speed.copy_bandwidth,
            "checkpoint": dcp.checkpoint_pause}


def record(device, sizes, argv, only=None, log=sys.stderr, after_each=None):
    """Run every section (or those in ``only``); print each section's seconds to ``log``. On a GPU
    a section that raises is recorded as "error: ..." and the others still run; in the dry run it raises.
    ``after_each(out)`` is called after every section with what is recorded so far (``complete``
    False until the last): a run stopped at a time limit keeps the sections it finished."""
    out = {"provenance": provenance(argv, device), "sizes": asdict(sizes), "seconds": {}, "sections": {},
           "complete": False}
    for name, run in sections().items():
        if only and name not in only:
            continue
        start = timing.now()
        try:
            out["sections"][name] = run(device, sizes)
        except Exception as exc:  # noqa: BLE001  on a GPU one broken section must not cost the others
            if device.type != "cuda":
                raise                 # the dry run is the test: a bug there fails loudly
            out["sections"][name] = f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
            torch.cuda.empty_cache()
        out["seconds"][name] = round(timing.now() - start, 3)
        print(f"[labs.gpu] {name}: {out['seconds'][name]:.1f} s", file=log, flush=True)
        if after_each is not None:
            after_each(out)
    out["complete"] = True
    return out


def write_results(result, device):
    """Write results/gpu/<device-slug>.json: only ever from a run on a CUDA device."""
    if device.type != "cuda":
        raise ValueError("a results file is written only by a run on a GPU; use --dry-run on a CPU.")
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, device_slug(result["provenance"]["device"]) + ".json")
    with open(path, "w") as f:
        json.dump(cli.plain(result), f, indent=1, sort_keys=True)
        f.write("\n")
    return path


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description="Record the book's GPU figures (issue 19).")
    p.add_argument("--dry-run", action="store_true",
                   help="every section on the CPU at tiny sizes; print the JSON, write no file")
    p.add_argument("--only", nargs="+", choices=list(sections()), help="run only these sections")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise ValueError(REFUSAL)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    keep = None if args.dry_run else (lambda so_far: write_results(so_far, device))
    result = record(device, DRY if args.dry_run else Sizes(), argv, args.only, after_each=keep)
    if args.dry_run:
        print(json.dumps(cli.plain(result), indent=1, sort_keys=True))
    else:
        print(f"wrote {write_results(result, device)}")
