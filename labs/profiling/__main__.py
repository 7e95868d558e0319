"""``python -m labs.profiling --lab ddp --world-size 2 --json``: `labs.profiling.lab`'s command."""
from labs.launcher import cli
from labs.profiling import lab

cli.main(lab.main)
