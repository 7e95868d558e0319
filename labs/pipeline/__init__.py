"""pipeline (docstring written below)."""
