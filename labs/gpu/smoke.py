"""The chapters' labs on this machine's own backend choice at world size 1: on a GPU box, NCCL with
the rank's tensors on its GPU, the path the device audit (tests/test_devices.py) checks on a CPU.

`run_each` runs each lab's rank function once on the rank the launcher started and records, per
lab, "ok" with its seconds, or the exception's first line; one failing lab never stops the others.
Chapter 1's lab reports its CUDA peak per recipe (reset before each recipe's step).

    python -m labs.gpu.smoke --json
"""
import importlib

import torch.distributed as dist

from labs.launcher import launch
from labs.measure import timing

# (rank function, args, kwargs): small sizes, every one of them meaningful on a single rank
LABS = [
    ("labs.memory_budget.budget.measure", (), {"recipes": ("mixed", "fp32"), "shapes": ((1, 8),)}),
    ("labs.data_parallel.ddp_internals.walk_cost", (), {"depth": 4, "steps": 2}),
    ("labs.data_parallel.ddp.run", (1,), {}),
    ("labs.data_parallel.ring_allreduce.run", (1001,), {"repeats": 1}),
    ("labs.data_parallel.bus_bandwidth.rank_sweep", ([4096, 1 << 20],), {"repeats": 2}),
    ("labs.zero.stages.run", (3,), {"steps": 1}),
    ("labs.zero.stages.fsdp2", (1,), {"batch_size": 1}),
    ("labs.tensor_parallel.blocks.check_blocks", (), {}),
    ("labs.context_parallel.methods.check", (), {"order": "contiguous"}),
    ("labs.expert_parallel.dropless.check_grouped", (), {}),
]


def run_each(rank, world_size, labs=LABS):
    """Each lab's rank function once, here: {name: {"ok": bool, "seconds", "error"}} and chapter 1's
    CUDA peaks (None on a CPU)."""
    out, peaks = {}, None
    for name, args, kwargs in labs:
        module, _, fn = name.rpartition(".")
        start = timing.now()
        try:
            result = getattr(importlib.import_module(module), fn)(rank, world_size, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001  the finding is which lab breaks, and how
            out[name] = {"ok": False,
                         "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"}
            continue
        out[name] = {"ok": True, "seconds": round(timing.now() - start, 3)}
        if name.endswith("budget.measure"):
            peaks = {r: v["cuda_peak_bytes"] for r, v in result["recipes"].items()}
    return {"backend": dist.get_backend(), "labs": out, "cuda_peak_bytes_by_recipe": peaks}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("The chapters' labs at world size 1 on this machine's backend (NCCL on a GPU box).",
                   world_size_default=1)
    args = cli.parse(p, argv)
    if args.world_size != 1:
        raise ValueError(f"the smoke run is one rank, got --world-size {args.world_size}; drop it.")
    r = launch.launch(run_each, 1, timeout=args.timeout)[0]
    bad = [k for k, v in r["labs"].items() if not v["ok"]]
    cli.report(r, args, f"{r['backend']}: {len(r['labs']) - len(bad)} of {len(r['labs'])} labs ran"
               + (f"; failed: {', '.join(bad)}" if bad else ""))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
