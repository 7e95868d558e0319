"""Chapter 6, sequence and context parallel: splitting what tensor parallelism leaves whole, then attention.

- `sp_layers`: Megatron sequence parallelism, f_sp and g_sp (the paper's g, g-bar) around chapter 4's block.
- `sequence_parallel`: the SP block equals the TP block and one process, and its counted bytes are TP's.
- `sequence_parallel_activations`: every row of Korthikanti et al.'s Table 2, measured per rank.
- `ring_attention`: ring attention, K/V blocks around a ring, forward and backward by hand.
- `ulysses`: DeepSpeed-Ulysses, one fused QKV all-to-all from a sequence split to a head split.
- `allgather_cp`: all-gather context parallelism, as in Llama 3.
- `methods`: the three against one process's attention, the contiguous and zig-zag splits, work counted.
- `layout_figure`: the picture of the causal score matrix split contiguously and zig-zag.
- `figures`: the ring's steps under the zig-zag split, and the layouts around f_sp, g_sp and Ulysses.
- `crossover`: the KV-head ratio k/a at which each method sends the fewest bytes.
- `hybrid`: Ulysses inside a node and the ring across nodes (USP), bytes per link tier counted.
- `ring_steps`: the ring's compute and wait per step and rank, contiguous against zig-zag.
- `traps`: the loss over a sharded sequence, normalised per rank or by the global count.
- `jobs`: the context-parallel labs in one job of cp ranks, for the notebook (each as it runs alone).
"""
