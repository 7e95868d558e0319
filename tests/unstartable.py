"""Imports in the test process and fails in a spawned rank: the launcher's start-failure test."""
import os
import sys

if os.path.basename(sys.argv[0]) == "_rank.py":
    raise ImportError("deliberately unimportable in a rank")


def work(rank, world_size):
    return rank
