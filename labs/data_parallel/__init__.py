"""data_parallel (docstring written below)."""
