"""failures (docstring written below)."""
