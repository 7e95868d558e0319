"""``python -m labs.precision --experiment NAME --json``: every experiment of chapter 8 (loss
scaling and FP8), through `labs.precision.experiment`."""
from labs.launcher import cli
from labs.precision import experiment, fp8, loss_scaling

if __name__ == "__main__":
    cli.main(lambda: experiment.main(experiments={**loss_scaling.EXPERIMENTS, **fp8.EXPERIMENTS}))
