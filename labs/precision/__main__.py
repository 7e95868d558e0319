"""``python -m labs.precision --experiment NAME --json``: every experiment of chapter 8, through
`labs.precision.experiment`."""
from labs.launcher import cli
from labs.precision import experiment, fp8, fp8_wire, kernels, loss_scaling, master_weights, scaling

MODULES = (loss_scaling, fp8, kernels, fp8_wire, scaling, master_weights)

if __name__ == "__main__":
    cli.main(lambda: experiment.main(experiments={k: v for m in MODULES for k, v in m.EXPERIMENTS.items()}))
