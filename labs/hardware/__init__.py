"""Chapter 11, hardware reality: this machine's links measured, and which group sits on which link.

- `machine`: copy bandwidth and loopback latency measured here, and a real two-node torchrun launch.
- `latency`: the loopback's latency alpha (chapter 10's, the fastest small exchange) beside a one-way
  ping-pong and a fitted intercept, ingredient by ingredient.
- `placement`: the bytes each link tier carries for a layout, by chapter 11's group-by-group rule
(`labs.dims`).
- `boundary`: the bytes crossing a simulated node boundary, counted by each message's destination.
"""
