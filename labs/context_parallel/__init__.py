"""context_parallel (docstring written below)."""
