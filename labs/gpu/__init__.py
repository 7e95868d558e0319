"""gpu (docstring written below)."""
