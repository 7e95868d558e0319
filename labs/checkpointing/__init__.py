"""checkpointing (docstring written below)."""
