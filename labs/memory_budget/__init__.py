"""Chapter 1, the memory budget: bytes per parameter, activations, FLOPs, and whether a model fits.

The formulas (the model shape, recipes, activations, FLOPs, the calculator) are torch-free, in
`labs.formulas`; these modules are the labs that measure them on the tiny models, and re-export them.

- `budget`: the calculator (bytes per device for a configuration) and the lab that measures it.
- `recipes`: mixed-precision recipes and the hand Adam, whose bytes per parameter the chapter counts;
  `torch.optim.Adam`'s state and the temporaries of its step, measured.
- `activations`: what a GPT-3 or Llama block saves for backward, formula against autograd's bytes.
- `logits`: the s x b x V tensors at the top of the model, formula against the measured peak.
- `compute`: FLOPs per token (6P + 12Lhs) against the counted FLOPs, MFU and HFU, Llama 3's Table 4.
- `zero_paper`: the ZeRO paper's Table 1, every published entry, and its communication volumes.
- `fused_swiglu`: a fused SwiGLU keeps 6sbf bytes, not 8sbf: autograd's saved bytes against the formula (used
by chapter 14).
- `step_memory`: memory over two training steps by kind (weights, gradients, Adam's state, activations),
  and the sequence length at which a Llama model's activations pass its model state.
- `calculator`: the slider calculator for a reader in JupyterLab, the same numbers as tables on the site.
"""
