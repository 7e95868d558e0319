"""collectives (docstring written below)."""
