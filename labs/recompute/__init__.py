"""recompute (docstring written below)."""
