"""hardware (docstring written below)."""
