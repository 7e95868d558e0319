"""Chapter 6, sequence and context parallel: splitting what tensor parallelism leaves whole, then attention.

- `sp_layers`: Megatron sequence parallelism, g and g-bar around chapter 4's split block.
- `sequence_parallel`: the SP block equals the TP block and one process, and sends what TP sends.
- `sequence_parallel_activations`: Korthikanti et al.'s Table 2, measured per rank.
- `ring_attention`: ring attention, K/V blocks around a ring, forward and backward by hand.
- `ulysses`: DeepSpeed-Ulysses, all-to-all from a sequence split to a head split.
- `allgather_cp`: all-gather context parallelism, as in Llama 3.
- `methods`: the three against one process's attention, the contiguous and zig-zag splits.
"""
