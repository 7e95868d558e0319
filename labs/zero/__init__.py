"""zero (docstring written below)."""
