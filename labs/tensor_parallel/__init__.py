"""tensor_parallel (docstring written below)."""
