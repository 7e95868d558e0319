"""launcher (docstring written below)."""
