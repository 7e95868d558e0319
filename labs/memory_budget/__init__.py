"""memory_budget (docstring written below)."""
