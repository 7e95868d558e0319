"""The command-line contract every lab keeps.

    python -m labs.<package>.<module> --world-size N [options] --json

prints one JSON object (the lab's result dict) as the last line of stdout; without ``--json`` it
prints a readable summary. Under torchrun only global rank 0 reports.
"""
import argparse
import json
import math
import os
import sys

from labs.launcher import preflight, supervise


def positive_int(text):
    """argparse type: a clear sentence instead of a traceback for 0, -1 or 2.5."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text, most=None):
    """argparse type: a finite number above 0 (and at most ``most``), else one clear sentence."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    if most is not None and value > most:
        raise argparse.ArgumentTypeError(f"expected at most {most:,}, got {text}")
    return value


def at_most(limit, why):
    """argparse type: a positive integer no larger than ``limit`` (``why`` says what it bounds)."""
    def check(text):
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"expected at most {limit:,} ({why}), got {value:,}")
        return value
    return check


def timeout_seconds(text):
    return positive_float(text, preflight.MAX_TIMEOUT_S)


def parser(description, world_size_default=2):
    p = argparse.ArgumentParser(description=description)
    default = f"default {world_size_default}; " if world_size_default else ""
    p.add_argument("--world-size", type=positive_int, default=None,
                   help=f"number of ranks ({default}under torchrun, torchrun's WORLD_SIZE, "
                   "which --world-size must match if given)")
    p.set_defaults(world_size_default=world_size_default)
    p.add_argument("--timeout", type=timeout_seconds, default=120.0,
                   help="seconds before a stuck run is stopped and its stuck ranks are named (default 120)")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON object on the last line of stdout")
    return p


def parse(p, argv=None):
    """Parse, then fill --world-size from torchrun's environment or the lab's default."""
    args = p.parse_args(argv)
    if args.world_size is None:
        torchrun_size = os.environ.get("WORLD_SIZE") if "TORCHELASTIC_RUN_ID" in os.environ else None
        args.world_size = int(torchrun_size) if torchrun_size else args.world_size_default
    return args


def under_torchrun():
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def main(run):
    """Run a lab's main(); a bad input ends with its one-sentence message, not a traceback."""
    try:
        run()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except supervise.RankError as exc:  # its message already holds the failing rank's own traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


def plain(value):
    """Make a result JSON-safe: tensors and numpy scalars become numbers and lists."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist"):  # torch.Tensor, numpy array or scalar
        return plain(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def report(result, args, summary):
    """Print the summary, or the JSON object when --json was given (under torchrun: rank 0 only)."""
    if under_torchrun() and os.environ["RANK"] != "0":
        return
    if args.json:
        print(json.dumps(plain(result), sort_keys=True))
    else:
        print(summary)
