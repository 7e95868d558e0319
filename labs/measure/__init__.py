"""measure (docstring written below)."""
