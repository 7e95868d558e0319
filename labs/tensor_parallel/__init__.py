"""Chapter 4, tensor parallel: the Megatron split of the MLP and attention, and where it stops paying.

- `megatron`: the operators f and g, column- and row-parallel linears, ``apply_tensor_parallel``.
- `split_figure`: the picture of the MLP split, cut where the lab cuts the weights.
- `forms`: the MLP as an all-reduce and as an all-gather + reduce-scatter, run and drawn; the
  collective matmul's picture.
- `blocks`: the split blocks equal the whole ones (outputs, gradients), payloads measured, training.
- `gqa_parallel`: grouped-query attention under tensor parallelism, KV heads split or replicated.
- `vocab_parallel`: the vocabulary split over ranks, embedding and cross-entropy by hand.
- `tp_limits`: when tensor parallelism stops paying, communication against compute per layer.
"""
