import os
import sys

import pytest

# Spawned ranks import test workers by name: make tests/ importable for them too.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    """Tests exercise the gloo path so they run the same on a laptop, in CI and on a GPU box."""
    monkeypatch.setenv("LABS_BACKEND", "gloo")
