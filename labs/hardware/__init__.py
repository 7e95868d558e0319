"""Chapter 11, hardware reality: this machine's links measured, and which group sits on which link.

- `machine`: copy bandwidth and loopback latency measured here, and a real two-node torchrun launch.
- `placement`: the bytes each link tier carries for a placement of TP, PP and DP groups.
"""
