"""``python -m labs.gpu``: record the book's GPU figures (`labs.gpu.record`)."""
from labs.gpu import record
from labs.launcher import cli

if __name__ == "__main__":
    cli.main(record.main)
