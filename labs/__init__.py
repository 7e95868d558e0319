"""Labs for *Distributed Training, Measured*: one file per technique.

Every lab runs multi-process through `labs.launcher.launch` and returns a plain result dict
that its chapter's notebook asserts on.
"""
