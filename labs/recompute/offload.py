"""Chapter 9: activation offloading, the other way to keep fewer activations on the device.

Instead of recomputing what backward needs, copy it to host memory after the forward uses it and
copy it back when backward asks (PyTorch: ``torch.autograd.graph.save_on_cpu``, a pair of
saved-tensor hooks). The device keeps almost nothing between forward and backward; the price is
bytes over the host link, twice, instead of FLOPs.

On a CPU-only machine host and device are the same memory, so this lab *simulates* the split, and
says so: `HostPool` packs every saved activation into a numpy array, memory that ATen's allocator
does not own and `memory.PeakMemory` (the live-storage high-water mark standing in for the device)
does not count; unpacking copies it back into a fresh ATen tensor, as a host-to-device copy
allocates on the device. The copies are real memcpys and are counted byte for byte in each
direction; their speed says nothing about PCIe or NVLink and is not reported. Parameters are not
offloaded (saved-tensor hooks also see weights, which the device keeps anyway).

torch's own ``save_on_cpu`` is run beside it: on this machine its pack is ``tensor.cpu()``, which
returns a CPU tensor itself, so it keeps exactly what no offloading keeps (measured).
"""
import torch

from labs.measure import memory
from labs.recompute import policies


class HostPool:
    """Saved-tensor hooks that move activations to a "host" outside the measured device memory."""

    def __init__(self, modules):
        self.params = set()
        memory.storage_bytes([t for m in modules for t in [*m.parameters(), *m.buffers()]], self.params)
        self.to_host = self.to_device = self.held = self.peak_held = 0

    def _is_param(self, t):
        s = t.untyped_storage()
        return (s.device, s.data_ptr()) in self.params

    def pack(self, t):
        if self._is_param(t):
            return ("device", t)
        host = t.detach().contiguous().view(-1).view(torch.uint8).numpy().copy()  # the copy "to the host"
        self.to_host += host.nbytes
        self.held += host.nbytes
        self.peak_held = max(self.peak_held, self.held)
        return ("host", host, t.dtype, t.shape)

    def unpack(self, packed):
        if packed[0] == "device":
            return packed[1]
        _, host, dtype, shape = packed
        self.to_device += host.nbytes
        return torch.from_numpy(host).clone().view(dtype).view(shape)  # a fresh device tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def measure(mode, cfg=None, batch=2, dtype=torch.bfloat16):
    """One forward and backward of the chapter's block stack with ``mode`` "none", "hand offload"
    (`HostPool`) or "torch save_on_cpu": the bytes the forward leaves alive on the "device", the
    peak during forward and backward (both above the weights, `memory.PeakMemory`), and the bytes
    copied to the host and back."""
    cfg = cfg or policies.config()
    blocks, x, run = policies._step(cfg, batch, "none", 2, dtype)
    pool = HostPool(blocks)
    hooks = {"none": torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
             "hand offload": pool.hooks(),
             "torch save_on_cpu": torch.autograd.graph.save_on_cpu(pin_memory=False)}[mode]
    with memory.PeakMemory(*blocks) as mem:
        with hooks:
            loss = run(x).float().sum()
        kept = mem.end_bytes - mem.baseline_bytes - loss.untyped_storage().nbytes()
        loss.backward()
    grads = [x.grad] + [p.grad for b in blocks for p in b.parameters()]
    return {"mode": mode, "kept_bytes": kept, "peak_bytes": mem.peak_net, "to_host_bytes": pool.to_host,
            "to_device_bytes": pool.to_device, "host_peak_bytes": pool.peak_held, "grads": grads}


def compare(cfg=None, batch=2, dtype=torch.bfloat16):
    """The three modes side by side; gradients compared with "none"'s (a copy there and back
    changes no bit). Also what a copy-per-saved-tensor offload must move, read from the autograd
    graph of a run without hooks (`graph_saved_bytes`), not from a hook like the one it checks."""
    cfg = cfg or policies.config()
    rows = {m: measure(m, cfg, batch, dtype) for m in ("none", "hand offload", "torch save_on_cpu")}
    base = rows["none"]["grads"]
    for r in rows.values():
        r["grads_equal"] = all(torch.equal(a, b) for a, b in zip(r.pop("grads"), base))
    blocks, x, run = policies._step(cfg, batch, "none", 2, dtype)
    return {"rows": rows, "saved_tensor_bytes": graph_saved_bytes(run(x).float().sum(), HostPool(blocks)),
            "formula_bytes": policies.formula_bytes("none", cfg, batch, dtype=dtype)}


def graph_saved_bytes(loss, pool):
    """The bytes of every tensor the autograd graph behind ``loss`` holds for backward, read from
    the nodes themselves (their ``_saved_*`` attributes), not from a hook: one count per node that
    saves a tensor, as a pack hook is called once per save, parameters left out. Python scalars
    that autograd wraps as 0-dim float64 tensors (``x * 0.125``) are not saved tensors: no hook sees
    them."""
    total, seen, stack = 0, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                for t in value if isinstance(value, (tuple, list)) else [value]:
                    wrapped = isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == torch.float64
                    if isinstance(t, torch.Tensor) and not wrapped and not pool._is_param(t):
                        total += t.numel() * t.element_size()
        stack += [nxt for nxt, _ in node.next_functions]
    return total


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Activation offloading, simulated on a CPU: bytes kept, peak, bytes moved.",
                   world_size_default=1)
    args = cli.parse(p, argv)
    if args.world_size not in (None, 1):
        raise ValueError(f"offloading runs in one process; drop --world-size {args.world_size} or pass 1.")
    r = compare()
    cli.report(r, args, "\n".join(f"{m}: kept {v['kept_bytes']} B, peak {v['peak_bytes']} B, to host "
                                  f"{v['to_host_bytes']} B, back {v['to_device_bytes']} B"
                                  for m, v in r["rows"].items()))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
