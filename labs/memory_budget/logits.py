"""Chapter 1, logits and loss: the s x b x V tensors at the top of the model, which the per-layer
activation formulas (`labs.memory_budget.activations`) leave out.

What the tiny GPT's tail (``GPT.forward`` after the blocks: the LM head, then a cross-entropy in
fp32, ``F.cross_entropy(logits.float(), targets)``) does with memory, in a bf16 model, with s tokens
per sequence, b sequences, hidden h and vocabulary V:

    saved for backward   the head's input 2sbh, the fp32 log-softmax 4sbV, the int64 targets 8sb,
                         nll_loss's fp32 total weight 4:                 2sbh + 4sbV + 8sb + 4
                         (not the bf16 logits: the cast to fp32 needs nothing for backward)
    forward high-water   bf16 logits 2sbV + their fp32 copy 4sbV + the log-softmax 4sbV, all alive
                         when nll_loss runs: 10sbV above what was live when the head started
                         (plus the loss and total weight, 8 bytes, and a copy of the targets, 8sb,
                         when they arrive as a non-contiguous slice, as `synthetic_batch`'s do)

At a 128K vocabulary (Llama Team 2024, arXiv 2407.21783, §3.2 and Table 3, which prints 128,000;
V = 128,256 is the released Llama 3 config's vocab_size)
the 4sbV kept for backward is, at s = 8192, about as much as a whole Llama block keeps: `at_scale`.
Vocabulary-parallel cross-entropy (Megatron, chapter 4) divides all of it by tp; fused or chunked
cross-entropy kernels never write the fp32 copies.
"""
import torch

from labs.measure import memory
from labs import model as tiny
from labs.formulas.activations import (  # the formulas' home is the torch-free core
    tail_backward_peak_bytes as tail_backward_peak_bytes, tail_forward_peak_bytes as
    tail_forward_peak_bytes, tail_saved_bytes as tail_saved_bytes)
from labs.formulas.memory import (  # the formulas' home is the torch-free core
    at_scale as at_scale)


class _Armed:
    """Saved-tensor recorder armed by a forward pre-hook on the head: records the tail only."""

    def __init__(self, net, mem):
        self.record = memory.SavedTensors(exclude={(t.untyped_storage().device,
                                                    t.untyped_storage().data_ptr())
                                                   for t in list(net.parameters()) + list(net.buffers())})
        self.armed, self.mem, self.live_at_head = False, mem, None

    def pre_hook(self, module, args):  # returns None: the head's input is left alone
        self.armed, self.live_at_head = True, self.mem.net

    def pack(self, t):
        if self.armed:
            self.record.pack(t)
        return t


def measure_tail(cfg=None, batch=2, seq=None, dtype=torch.bfloat16):
    """Saved bytes (saved-tensor hooks armed at the LM head) and the forward high-water mark of the
    tail (`memory.PeakMemory`, above the live bytes when the head started) of the tiny GPT, beside
    the formulas. Sizes come from the logits and batch actually run."""
    cfg = cfg or tiny.GPTConfig(vocab_size=512)   # V >> h, as in real models
    net = tiny.build(cfg, dtype=dtype)
    x, y = tiny.synthetic_batch(cfg, batch, seed=0, seq_len=seq)
    mem = memory.PeakMemory(net)
    arm = _Armed(net, mem)
    shapes = {}

    def logits_shape(module, args, out):  # returns None: the logits are left alone
        shapes["logits"] = tuple(out.shape)
    hooks = [net.head.register_forward_pre_hook(arm.pre_hook), net.head.register_forward_hook(logits_shape)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(arm.pack, lambda t: t), mem:
            loss = net(x, y)
            peak = mem.peak_net - arm.live_at_head
    finally:
        for hk in hooks:
            hk.remove()
    b, s, V = shapes["logits"]
    e = torch.empty(0, dtype=dtype).element_size()
    return {"b": b, "s": s, "V": V, "h": cfg.hidden, "dtype": str(dtype), "saved_bytes": arm.record.bytes,
            "saved_by_dtype": arm.record.by_dtype(), "forward_peak_bytes": peak, "peak_op": mem.peak_op,
            "saved_formula": tail_saved_bytes(s, b, cfg.hidden, V, e),
            "forward_peak_formula": tail_forward_peak_bytes(s, b, V, e, target_copy=not y.is_contiguous()),
            "loss": loss.item()}


