"""Byte accounting (chapter 1) and the peak of live storage during a block (chapters 3 onwards)."""
import torch

from labs.measure import memory


def test_storage_bytes_count_each_storage_once():
    flat = torch.zeros(100)
    views = [flat[:40], flat[40:], flat.view(10, 10)]
    assert memory.storage_bytes(views) == 400
    assert memory.storage_bytes([torch.zeros(3, dtype=torch.bfloat16), None]) == 6


def test_state_bytes_do_not_count_a_tensor_twice():
    net = torch.nn.Linear(4, 4)
    net(torch.randn(2, 4)).sum().backward()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    held = memory.state_bytes(net, opt)
    assert held == {"parameters": 80, "gradients": 80, "optimizer_state": 80, "total": 240}


def test_saved_for_backward_leaves_parameters_out():
    lin = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(3, 8, requires_grad=True)
    with memory.saved_for_backward(lin) as saved:
        lin(x)
    assert saved.bytes == x.numel() * 4  # the input is saved; the weight is a parameter, not counted


def test_peak_counts_temporaries_while_they_live():
    x = torch.ones(1000)                      # 4000 bytes, there before the block: the baseline
    with memory.PeakMemory(x, timeline=True) as mem:
        a = x * 2                             # +4000
        b = a + 1                             # +4000: both alive, the peak
        del a                                 # -4000
        s = (b * 3 + 1).sum()                 # +4000 (b*3), +4000 (+1) while b*3 lives... then both go
    assert mem.baseline_bytes == 4000
    # a forgotten free (no weakref callback) would end at 16004, an uncounted output at 4000
    assert mem.peak_bytes == 4000 + 12000 and mem.peak_op == "aten.add.Tensor"
    assert mem.end_bytes == 4000 + 4000 + 4   # b and the scalar sum remain
    assert mem.timeline == [4000, 8000, 8000, 12000, 8004]
    del b, s


def test_resize_to_zero_stops_counting_and_regrowth_counts_again():
    w = torch.ones(1000)                      # an FSDP-style buffer: 4000 bytes
    original = torch.UntypedStorage.resize_
    with memory.PeakMemory(w) as mem:
        w.untyped_storage().resize_(0)        # FSDP's free
        y = torch.zeros(500)                  # +2000, still below the baseline
        assert mem.peak_bytes == 4000
        w.untyped_storage().resize_(4000)     # gathered again: +4000
        w.data.fill_(1.0)
    assert mem.baseline_bytes == 4000
    assert mem.peak_bytes == 4000 + 2000 and mem.end_bytes == 6000
    assert mem.peak_op == "UntypedStorage.resize_"
    assert torch.UntypedStorage.resize_ is original   # the wrapper is gone after the block
    del y


def test_peak_of_a_backward_pass():
    """y = sum(relu(x @ w)): forward keeps x @ w's output (saved by relu) and relu's output; backward
    allocates the gradients. Everything here is fp32 of known shapes."""
    x = torch.randn(8, 16)
    w = torch.randn(16, 32, requires_grad=True)
    with memory.PeakMemory(x, w) as mem:
        h = x @ w                             # (8, 32): 1024 bytes
        r = h.relu()                          # 1024, saved for backward
        loss = r.sum()                        # 4
        del h, r
        loss.backward()
    assert mem.baseline_bytes == 8 * 16 * 4 + 16 * 32 * 4
    assert w.grad.shape == (16, 32)
    # after the block: w.grad (2048 bytes) and the loss (4) remain; the graph is gone
    assert mem.end_bytes == mem.baseline_bytes + 2048 + 4
    # the peak is at the weight-gradient matmul: the loss (4), its seed gradient (4), relu's input
    # gradient (1024) and w.grad (2048). relu's saved output (1024) was released as soon as relu's
    # backward ran; a tracker that missed frees inside backward would report 1024 more.
    assert mem.peak_bytes - mem.baseline_bytes == 4 + 4 + 1024 + 2048
    assert mem.peak_op == "aten.mm.default"
