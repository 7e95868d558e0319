"""Chapter 8's command line: run one mixed-precision experiment and report it.

    python -m labs.precision --experiment fp8-scaling --json        # any experiment of the chapter
    python -m labs.precision.fp8 --experiment fp8-scaling         # one file's own experiments
    python -m labs.precision.loss_scaling --experiment loss-scaling

The experiments live in the chapter's modules, each an ``EXPERIMENTS`` dict (a name -> function of
the parsed arguments returning (result, summary)); this module imports none of them, so each runs
its own experiments through it and `labs/precision/__main__.py` runs them all.
"""
from labs.launcher import cli


def main(argv=None, experiments=None):
    """Parse ``--experiment NAME`` (one of ``experiments``), run it, report its result."""
    p = cli.parser("Mixed precision (chapter 8): FP16 underflow, loss scaling, FP8 scaling, accumulation.")
    p.add_argument("--experiment", choices=sorted(experiments), required=True)
    p.add_argument("--steps", type=cli.positive_int, default=12, help="training steps (loss-scaling, track)")
    args = cli.parse(p, argv)
    result, summary = experiments[args.experiment](args)
    cli.report(result, args, summary)
