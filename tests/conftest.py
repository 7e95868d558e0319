import os
import sys

# Tests exercise the gloo path so they run the same on a laptop, in CI and on a GPU box. Set at
# import, before any fixture: a module-scoped fixture that starts ranks is built before any
# function-scoped one, and on a GPU box a one-rank run would otherwise get NCCL. A test that
# checks the backend choice itself sets or removes the variable with monkeypatch.
os.environ["LABS_BACKEND"] = "gloo"

# Spawned ranks import test workers by name: make tests/ importable for them too.
sys.path.insert(0, os.path.dirname(__file__))
