"""What the launcher decides before any rank starts: world size, timeout, memory and backend.

Bad input is refused here in one sentence, before a process exists: a world size that is not a
positive integer, a timeout that is not a number of seconds in (0, 86,400], a run larger than the
machine's memory. The backend is NCCL with one GPU per rank when the machine has at least
``world_size`` GPUs, else gloo on the CPU; ``LABS_BACKEND=gloo`` or ``LABS_BACKEND=nccl`` forces
one, except for a rank function marked `on_cpu`, which always gets gloo. `labs.launcher.launch` (spawn),
`labs.launcher.torchrun` (torchrun's ranks) and the command line (`labs.launcher.cli`) all check with these
functions, and none of them is imported here.
"""
import math
import os

import torch

BACKENDS = ("gloo", "nccl")
BACKEND_ENV = "LABS_BACKEND"
# The process group's own timeout is longer than ours, so a rank blocked on a hung peer does not
# raise a generic gloo timeout first: our deadline fires and names the rank that really hung.
_GROUP_TIMEOUT_MARGIN_S = 30.0
MAX_TIMEOUT_S = 86_400
# Resident size of one rank on gloo once torch is imported (measured: about 440 MiB).
RANK_BYTES = 450 * 1024 ** 2
MAX_RANKS_ENV = "LABS_MAX_RANKS"


def check_world_size(world_size):
    """Refuse anything but a positive integer, in one sentence."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}; pass e.g. 2.")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}; pass e.g. 2.")
    return world_size


def on_cpu(reason):
    """Mark a rank function that runs on the CPU with gloo on every machine, GPU boxes included,
    and say why (it measures gloo's own wire, say, or emulates compute with sleeps): the backend
    choice reads the mark, so the lab never gets NCCL with tensors NCCL would refuse."""
    def mark(fn):
        fn.labs_on_cpu = reason
        return fn
    return mark


def choose_backend(world_size, backend=None, fn=None):
    """NCCL when every rank can have its own GPU, else gloo; ``backend`` or $LABS_BACKEND forces one.

    A rank function ``fn`` marked `on_cpu` gets gloo whatever $LABS_BACKEND says (the variable sets
    a machine's default, the mark is the lab's own requirement); asking it for NCCL by argument is
    refused."""
    reason = getattr(fn, "labs_on_cpu", None)
    if reason:
        if backend == "nccl":
            raise ValueError(f"{fn.__qualname__} runs on the CPU ({reason}); drop backend='nccl'.")
        return "gloo"
    forced = backend or os.environ.get(BACKEND_ENV) or None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if forced is None:
        return "nccl" if gpus >= world_size else "gloo"
    if forced not in BACKENDS:
        raise ValueError(f"unknown backend {forced!r}; use one of {', '.join(BACKENDS)} "
                         f"(or unset {BACKEND_ENV} to let the launcher choose).")
    if forced == "nccl" and gpus < world_size:
        fix = f"lower the world size to {gpus} or" if gpus else "run on a GPU machine or"
        raise ValueError(f"NCCL needs one GPU per rank: {world_size} ranks asked, {gpus} GPUs here; "
                         f"{fix} set {BACKEND_ENV}=gloo.")
    return forced


def check_timeout(timeout):
    """A number of seconds, positive and finite: 0, -1, nan and inf are refused in one sentence."""
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not ok or not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:,}, "
                         f"got {timeout!r}; pass e.g. 60.")
    return float(timeout)


def available_bytes():
    """Memory the machine can still give (MemAvailable on Linux), or None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(world_size, bytes_per_rank=0, what=""):
    """Refuse, before anything starts, a run this machine's memory cannot hold.

    Each rank is a Python process that has imported torch (RANK_BYTES, measured as its resident
    size), plus ``bytes_per_rank`` for the lab's own tensors. $LABS_MAX_RANKS overrides the limit.
    """
    override = os.environ.get(MAX_RANKS_ENV)
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"{MAX_RANKS_ENV}={override!r} is not a positive integer; unset it or set "
                             "e.g. 64.")
        if world_size > int(override):
            raise ValueError(f"world_size {world_size} is above {MAX_RANKS_ENV}={override}; raise it or "
                             "use fewer ranks.")
        return
    free = available_bytes()
    need = world_size * (RANK_BYTES + bytes_per_rank)
    if free is None or need <= free:
        return
    most = int(free // (RANK_BYTES + bytes_per_rank))
    gib = 1024 ** 3
    extra = f" and {bytes_per_rank / gib:,.1f} GiB for {what}" if bytes_per_rank else ""
    fix = (f"use at most {most} ranks" + (f" or lower {what}" if what else "") if most
           else f"lower {what}")
    raise ValueError(f"{world_size} ranks need about {need / gib:,.1f} GiB ({RANK_BYTES / gib:.2f} GiB per "
                     f"process{extra}) but this machine has {free / gib:,.1f} GiB available; {fix}, "
                     f"or set {MAX_RANKS_ENV} to try anyway.")
