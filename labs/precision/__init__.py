"""precision (docstring written below)."""
