"""expert_parallel (docstring written below)."""
