"""Chapter 16's graders (labs/puzzles): each passes the book's own lab and refuses each classic mistake
with a message that names the difference.

The mistakes are written here as a reader would write them, at module level: the grader carries
their source to the ranks (they are not importable by a spawned rank as a lab is), so these tests
also exercise the carrying of a function and of a helper it calls.
"""
import contextlib
import inspect
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labs.measure import comm
from labs.data_parallel.hand_ring import ring_allreduce
from labs.tensor_parallel.megatron import parallelize_mlp
from labs.formulas.schedules import Action, gpipe, one_f_one_b
from labs.puzzles import ddp, dispatch, fsdp, grader, mlp, ring, ring_attn, schedule, zero1
from labs.zero.sharded_optimizer import ShardedOptimizer


def _passes(grade):
    assert grade.passed, grade.text
    return grade.text


def _refused(grade, *words):
    text = grade.text
    assert not grade.passed, text
    assert all(len(line) <= 88 for line in str(grade).splitlines()), str(grade)
    assert text.startswith("not yet: ") and "\nhint: " in text, text
    for w in words:
        assert w in text, f"{w!r} not in:\n{text}"
    return text


# ---- puzzle 1: the ring ----------------------------------------------------------------------

def ring_wrong_chunk(tensor):
    """Reduce-scatter adds the arriving chunk to the one it just sent, (r - 1 - s), not (r - 2 - s)."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.split(comm.ring_chunks(tensor.numel(), n)))
    for s in range(n - 1):
        send, k = chunks[(r - 1 - s) % n], (r - 1 - s) % n
        buf = torch.empty_like(chunks[k])
        reqs = [comm.isend(send, (r + 1) % n), comm.irecv(buf, (r - 1) % n)]
        for q in reqs:
            q.wait()
        chunks[k].add_(buf)
    for s in range(n - 1):
        send, k = chunks[(r + 1 - s) % n], (r - s) % n
        reqs = [comm.isend(send.clone(), (r + 1) % n), comm.irecv(chunks[k], (r - 1) % n)]
        for q in reqs:
            q.wait()


def ring_naive(tensor):
    """Everything to rank 0 and back: the right sum, (N-1) M bytes from rank 0."""
    n, r = dist.get_world_size(), dist.get_rank()
    if r == 0:
        buf = torch.empty_like(tensor)
        for src in range(1, n):
            comm.recv(buf, src)
            tensor.add_(buf)
        for dst in range(1, n):
            comm.send(tensor, dst)
    else:
        comm.send(tensor, 0)
        comm.recv(tensor, 0)


def ring_recv_first(tensor):
    """Every rank receives before it sends: nobody sends."""
    n, r = dist.get_world_size(), dist.get_rank()
    buf = torch.empty_like(tensor)
    comm.recv(buf, (r - 1) % n)
    comm.send(tensor, (r + 1) % n)


def ring_direct(tensor):
    """The referee's: each chunk straight to its owner, the sums straight back: not a ring."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.split(comm.ring_chunks(tensor.numel(), n)))
    bufs = {j: torch.empty_like(chunks[r]) for j in range(n) if j != r}
    reqs = [comm.isend(chunks[j], j) for j in bufs] + [comm.irecv(bufs[j], j) for j in bufs]
    for q in reqs:
        q.wait()
    for j in sorted(bufs):
        chunks[r].add_(bufs[j])
    reqs = [comm.isend(chunks[r], j) for j in bufs] + [comm.irecv(chunks[j], j) for j in bufs]
    for q in reqs:
        q.wait()


def ring_even_only(tensor):
    """The referee's: a ring that assumes N divides numel (view(N, -1))."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.view(n, -1))
    for s in range(n - 1):
        k = (r - 2 - s) % n
        a = torch.empty_like(chunks[k])
        for q in [comm.isend(chunks[(r - 1 - s) % n], (r + 1) % n), comm.irecv(a, (r - 1) % n)]:
            q.wait()
        chunks[k].add_(a)
    for s in range(n - 1):
        left, right = (r - 1) % n, (r + 1) % n
        reqs = [comm.isend(chunks[(r - s) % n], right), comm.irecv(chunks[(r - 1 - s) % n], left)]
        for q in reqs:
            q.wait()


def test_ring_passes_chapter_2s_ring():
    text = _passes(ring.grade(ring_allreduce))
    assert "2M - chunk_r - chunk_(r+1) = 68, 72, 68 bytes" in text and "each to rank r + 1" in text


def test_ring_refuses_a_direct_allreduce_by_its_peers():
    _refused(ring.grade(ring_direct), "rank 0's message 2 (send, 16 bytes) went to rank 2",
             "sends only to r + 1 = 1", "N - 1 peers at once")


def test_ring_refuses_a_ring_for_even_chunks_only():
    _refused(ring.grade(ring_even_only), "raised RuntimeError", "ring_even_only, line")


def test_ring_refuses_the_wrong_chunk():
    # at 12 elements every chunk has the same size, so the wrong one is received and summed; at the
    # grader's 13 the sizes differ and gloo aborts, which the hint names
    _refused(ring.grade(ring_wrong_chunk, numel=12), "holds the wrong sum in chunk", "chunk indices")


def test_ring_refuses_the_naive_allreduce_by_its_bytes():
    _refused(ring.grade(ring_naive), "rank 0's message 1 (recv, 52 bytes) came from rank 1",
             "it sent 104 bytes, the ring 68", "the naive all-reduce")


def test_ring_names_the_deadlock_and_the_call():
    # a deadline of 5 s: the launcher counts it from the spawn, and a slow start is retried once
    _refused(ring.grade(ring_recv_first, deadline=5), "deadline of 5 s", "deadlock", "in recv")


def ring_nan(tensor):
    """The referee's: a right ring, then one element NaN (any NaN-making bug): NaN compares false."""
    ring_allreduce(tensor)
    tensor[5] = float("nan")


def ring_rank0_returns(tensor):
    """Rank 0 returns at once: the others wait for its messages."""
    if dist.get_rank() == 0:
        return
    ring_allreduce(tensor)


def ring_on_a_copy(tensor):
    """The referee's: a right ring on a copy, returned; the input is left as it was."""
    t = tensor.clone()
    ring_allreduce(t)
    return t


def ring_rank1_sleeps(tensor):
    """Rank 1 never communicates (it sleeps: outside any call); ranks 0 and 2 wait in the ring."""
    if dist.get_rank() == 1:
        while True:
            time.sleep(0.05)
    ring_allreduce(tensor)


def test_ring_refuses_nan():
    _refused(ring.grade(ring_nan), "rank 0's result element 5 is NaN", "a NaN is never a rounding error",
             "a division by a count that is zero")


def test_ring_refuses_a_ring_on_a_copy():
    _refused(ring.grade(ring_on_a_copy), "rank 0's input tensor was not changed", "in place")


def test_ring_names_the_rank_that_returned():
    _refused(ring.grade(ring_rank0_returns, deadline=5), "rank 0 returned while rank 1 waits",
             "never sent what the others wait for", "a rank that returns before it has sent")


def test_ring_names_the_busy_rank_at_its_own_line():
    lines, first = inspect.getsourcelines(ring_rank1_sleeps)
    line = first + next(i for i, text in enumerate(lines) if "time.sleep" in text)
    text = _refused(ring.grade(ring_rank1_sleeps, deadline=5),
                    f"rank 1 of 3 hung: it was in your ring_rank1_sleeps, line {line} of test_puzzles.py",
                    "outside any communication call")
    assert f"rank 0 was at (your ring_rank1_sleeps, line {line}" not in text, text


def test_every_value_check_refuses_nan():
    err, bound = torch.tensor([0.0, float("nan"), 3.0]), torch.tensor([1.0, 1.0, 1.0])
    assert (err > bound).tolist() == [False, False, True]  # the trap: NaN compares false
    assert grader.exceeds(err, bound).tolist() == [False, True, True]
    assert grader.worst(err, bound) == 1


# ---- puzzle 3: ZeRO-1 ------------------------------------------------------------------------

def zero1_hand(params, lr):
    """A hand-written ZeRO-1 (the notebook's solution): Adam in another order than torch's."""
    n, r = dist.get_world_size(), dist.get_rank()
    params = list(params)
    shard = sum(p.numel() for p in params) // n
    lo = r * shard
    m, v = torch.zeros(shard), torch.zeros(shard)
    t = 0

    def step():
        nonlocal t
        t += 1
        grad = torch.empty(shard)
        comm.reduce_scatter(grad, torch.cat([p.grad.reshape(-1) for p in params]))
        grad /= n
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        m.mul_(0.9).add_(grad, alpha=0.1)
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        m_hat, v_hat = m / (1 - 0.9**t), v / (1 - 0.999**t)
        mine = flat[lo : lo + shard] - lr * m_hat / (v_hat.sqrt() + 1e-8)
        comm.all_gather(flat, mine)
        with torch.no_grad():
            for p, new in zip(params, flat.split([p.numel() for p in params])):
                p.copy_(new.view_as(p))

    return step


def zero1_full_state(params, lr):
    """Plain data parallelism: every rank keeps Adam's state for every parameter."""
    params = list(params)
    opt = torch.optim.Adam(params, lr=lr)

    def step():
        for p in params:
            comm.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
    return step


def zero1_allreduce(params, lr):
    """ZeRO's first DeepSpeed release: all-reduce (2(N-1)/N) where a reduce-scatter ((N-1)/N) does."""
    opt = ShardedOptimizer(params, torch.optim.Adam, stage=1, lr=lr, zero1_allreduce=True)

    def step():
        opt.step()
        opt.zero_grad()
        for b in opt.buckets:
            b.grad = None
    return step


def zero1_no_gather(params, lr):
    """Each rank updates its slice and never all-gathers: the other slices stay stale."""
    n, r = dist.get_world_size(), dist.get_rank()
    params = list(params)
    shard = sum(p.numel() for p in params) // n
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    mine = torch.nn.Parameter(flat[r * shard:(r + 1) * shard].clone())
    opt = torch.optim.Adam([mine], lr=lr)

    def step():
        grad = torch.empty(shard)
        comm.reduce_scatter(grad, torch.cat([p.grad.reshape(-1) for p in params]))
        mine.grad = grad / n
        opt.step()
        with torch.no_grad():
            flat[r * shard:(r + 1) * shard] = mine
            for p, new in zip(params, flat.split([p.numel() for p in params])):
                p.copy_(new.view_as(p))
    return step


def test_zero1_passes_chapter_3s_sharded_optimizer():
    text = _passes(zero1.grade(zero1.reference))
    assert "(bitwise)" in text and "= 232, counted" in text


def test_zero1_passes_a_hand_written_adam_within_the_bound():
    assert "kept per rank after the steps: 232, 232 bytes" in _passes(zero1.grade(zero1_hand))


def test_zero1_refuses_the_full_adam_state_by_its_bytes_kept():
    _refused(zero1.grade(zero1_full_state), "rank 0 keeps 480 bytes alive", "248 bytes too many",
             "8 Psi per rank")


def test_zero1_refuses_the_all_reduce_by_its_bytes_sent():
    _refused(zero1.grade(zero1_allreduce), "rank 0 sent 696 bytes", "232 bytes too many", "reduce-scatter")


def test_zero1_refuses_a_step_without_the_all_gather():
    _refused(zero1.grade(zero1_no_gather), "(in rank 1's slice)", "off by", "all-gather every rank's slice")


def zero1_no_divide(params, lr):
    """The referee's: the reduce-scattered gradient never divided by N (Adam nearly hides it)."""
    n, r = dist.get_world_size(), dist.get_rank()
    params = list(params)
    shard = sum(p.numel() for p in params) // n
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    opt_param = torch.nn.Parameter(flat[r * shard:(r + 1) * shard])
    opt = torch.optim.Adam([opt_param], lr=lr)

    def step():
        grad = torch.empty(shard)
        comm.reduce_scatter(grad, torch.cat([p.grad.reshape(-1) for p in params]))
        opt_param.grad = grad
        opt.step()
        flat = torch.empty(shard * n)
        comm.all_gather(flat, opt_param.detach())
        with torch.no_grad():
            for p, new in zip(params, flat.split([p.numel() for p in params])):
                p.copy_(new.view_as(p))
    return step


def zero1_keeps_flat_grad(params, lr):
    """The referee's: a full flat gradient buffer (4 Psi) kept between steps."""
    params = list(params)
    full = torch.zeros(sum(p.numel() for p in params))
    inner = zero1_hand(params, lr)

    def step():
        torch.cat([p.grad.reshape(-1) for p in params], out=full)
        inner()
    return step


def test_zero1_refuses_a_gradient_never_divided_by_n():
    _refused(zero1.grade(zero1_no_divide), "gradient N = 2 times the average", "never divided by N",
             "divide your slice by N")


def zero1_keeps_param_copy(params, lr):
    """The referee's: the step's flat copy of the weights kept between steps."""
    params = list(params)
    kept = []
    inner = zero1_hand(params, lr)

    def step():
        inner()
        kept[:] = [torch.cat([p.detach().reshape(-1) for p in params])]
    return step


def test_zero1_names_a_kept_copy_of_the_weights():
    _refused(zero1.grade(zero1_keeps_param_copy), "keeps 464 bytes alive after the steps",
             "holds a copy of the weights")


def test_zero1_names_a_kept_flat_gradient_buffer():
    _refused(zero1.grade(zero1_keeps_flat_grad), "keeps 464 bytes alive after the steps", "232",
             "a tensor of 4 Psi = 232 bytes is kept: a flat gradient buffer")


# ---- puzzle 5: Megatron's MLP ----------------------------------------------------------------

class _F(torch.autograd.Function):  # the reader's f and g would live in their cell; these are shared
    @staticmethod
    def forward(ctx, x, reduce_grad):
        ctx.reduce_grad = reduce_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if ctx.reduce_grad:
            comm.all_reduce(grad)
        return grad, None


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, times):
        x = x.contiguous().clone()
        for _ in range(times):
            comm.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _tp_mlp(mlp, f_reduces=True, g_times=1, bias_first=False):
    """A hand split with a switch per mistake (rank r keeps rows r*4h/N.. of fc, columns of proj)."""
    n, r = dist.get_world_size(), dist.get_rank()
    w = mlp.fc.out_features // n
    rows = slice(r * w, (r + 1) * w)
    fc_w = torch.nn.Parameter(mlp.fc.weight.detach()[rows].clone())
    fc_b = torch.nn.Parameter(mlp.fc.bias.detach()[rows].clone())
    pr_w = torch.nn.Parameter(mlp.proj.weight.detach()[:, rows].clone())
    pr_b = torch.nn.Parameter(mlp.proj.bias.detach().clone())
    mlp.fc.weight, mlp.fc.bias, mlp.proj.weight, mlp.proj.bias = fc_w, fc_b, pr_w, pr_b

    def forward(x):
        h = F.gelu(F.linear(_F.apply(x, f_reduces), fc_w, fc_b))
        y = F.linear(h, pr_w, pr_b if bias_first else None)
        z = _G.apply(y, g_times)
        return z if bias_first else z + pr_b
    mlp.forward = forward
    return mlp


def mlp_g_twice(mlp, group):
    return _tp_mlp(mlp, g_times=2)


def mlp_f_forgets_backward(mlp, group):
    return _tp_mlp(mlp, f_reduces=False)


def mlp_bias_on_every_rank(mlp, group):
    return _tp_mlp(mlp, bias_first=True)


def test_mlp_passes_chapter_4s_split():
    assert "384 bytes sent per rank" in _passes(mlp.grade(parallelize_mlp))


def test_mlp_helper_split_passes():
    _passes(mlp.grade(lambda_free_ok))


def lambda_free_ok(mlp, group):
    return _tp_mlp(mlp)


def mlp_nan(mlp, group):
    """The referee's: a right split whose output gets one NaN element."""
    mlp = parallelize_mlp(mlp, group)
    forward = mlp.forward

    def poisoned(x):
        z = forward(x)
        return torch.cat([torch.full((1,), float("nan")), z.reshape(-1)[1:]]).view_as(z)
    mlp.forward = poisoned
    return mlp


def test_mlp_names_a_nan():
    _refused(mlp.grade(mlp_nan), "rank 0's output element 0 is NaN", "a division by a count that is zero")


def test_mlp_refuses_g_twice():
    _refused(mlp.grade(mlp_g_twice), "rank 0's output differs", "N times too large")


def test_mlp_refuses_f_without_its_backward_all_reduce():
    _refused(mlp.grade(mlp_f_forgets_backward), "gradient of the MLP's input differs", "f's backward")


def test_mlp_refuses_the_bias_added_before_g():
    _refused(mlp.grade(mlp_bias_on_every_rank), "output differs", "bias was added on every rank")


# ---- puzzle 6: 1F1B as data ------------------------------------------------------------------

def schedule_warmup_backwards(p, m):
    """Stage s warms up with s forwards instead of p - 1 - s: stage 0 waits for a B that never comes."""
    out = []
    for s in range(p):
        w = min(s, m)
        acts = [Action("F", i) for i in range(w)]
        for i in range(m - w):
            acts += [Action("F", w + i), Action("B", i)]
        out.append(acts + [Action("B", i) for i in range(m - w, m)])
    return out


def schedule_drops_a_backward(p, m):
    lists = one_f_one_b(p, m)
    lists[1].remove(Action("B", m - 1))
    return lists


def schedule_builder_sleeps(p, m):
    """A builder that never returns (it sleeps): stopped on the ranks at the deadline, not in the notebook."""
    while True:
        time.sleep(0.05)


def test_schedule_runs_the_builder_under_the_deadline():
    _refused(schedule.grade(schedule_builder_sleeps, deadline=5), "your schedule_builder_sleeps, line",
             "outside any communication call")


def test_schedule_passes_chapter_5s_1f1b():
    assert "bubble: (p-1)/m = 1/2" in _passes(schedule.grade(one_f_one_b))


def schedule_for_two_stages(p, m):
    """The referee's: a warm-up written for p = 2 (stage 0 one forward, the others none)."""
    lists = []
    for s in range(p):
        w = 1 if s == 0 else 0
        acts = [Action("F", i) for i in range(w)]
        for i in range(m - w):
            acts += [Action("F", w + i), Action("B", i)]
        lists.append(acts + [Action("B", i) for i in range(m - w, m)])
    return lists


def test_schedule_refuses_a_warmup_for_two_stages_only():
    _refused(schedule.grade(schedule_for_two_stages), "the bubble is 5/4", "(p-1)/m = 1/2",
             "min(p - 1 - s, m) warm-up forwards")


def test_schedule_refuses_gpipe_by_its_memory():
    _refused(schedule.grade(gpipe), "stage 0 held 4 micro-batches", "holds min(p - s, m) = 3",
             "bytes too many")


def test_schedule_names_the_deadlock():
    _refused(schedule.grade(schedule_warmup_backwards, deadline=5), "deadline of 5 s",
             "stage 0 waits in B0 for stage 1's B0", "stage 1 waits in F1 for stage 0's F1")


def test_schedule_refuses_a_missing_backward_before_it_runs():
    _refused(schedule.grade(schedule_drops_a_backward), "stage 1 runs B of micro-batch 3 0 times")


# ---- puzzle 8: MoE dispatch and combine ------------------------------------------------------

def _route_sorted(moe, x, sort=True):
    """The (token, expert) pairs of x's routing, sorted by expert (hence by destination rank)."""
    r = moe.decide(x)
    e, g = r.idx.reshape(-1), r.gates.reshape(-1)
    t = torch.arange(x.shape[0]).repeat_interleave(moe.top_k)
    if sort:
        order = torch.argsort(e, stable=True)
        e, t, g = e[order], t[order], g[order]
    return e, t, g


def _ep(moe, group, sort=True, capacity=None):
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    per = moe.num_experts // ep
    mine = moe.experts[rank * per:(rank + 1) * per]

    def forward(x):
        e, t, g = _route_sorted(moe, x, sort)
        counts = torch.bincount(e, minlength=moe.num_experts)
        got = torch.empty_like(counts)
        comm.all_to_all(got, counts, group=group)
        send, recv = counts.view(ep, per).sum(1).tolist(), got.view(ep, per).sum(1).tolist()
        rows = x.new_empty(sum(recv), x.shape[1])
        comm.all_to_all(rows, x[t], group=group, output_split_sizes=recv, input_split_sizes=send)
        local = torch.arange(per).repeat(ep).repeat_interleave(got)
        y = torch.zeros_like(rows)
        for j, expert in enumerate(mine):
            y[local == j] = expert(rows[local == j])
        back = x.new_empty(len(t), x.shape[1])
        comm.all_to_all(back, y, group=group, output_split_sizes=send, input_split_sizes=recv)
        if capacity is not None:  # a combine buffer of capacity rows per expert: the rest is lost
            pos = torch.arange(len(e)) - (counts.cumsum(0) - counts)[e]
            back[pos >= capacity] = 0
        return torch.zeros_like(x).index_add(0, t, g[:, None] * back)
    return forward


def moe_hand(moe, group):
    return _ep(moe, group)


def moe_combine_drops_overfull(moe, group):
    """Combine keeps an even share, T k / N rows, per expert: the over-full expert's extra rows are lost."""
    return _ep(moe, group, capacity=8 * 2 // 4)


def moe_unsorted_dispatch(moe, group):
    """The pairs dispatched in token order: the split sizes describe blocks the rows are not in."""
    return _ep(moe, group, sort=False)


def moe_every_token_everywhere(moe, group):
    """Every rank gets every token (all T rows to each peer) and sends back a partial output for each."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    per = moe.num_experts // ep

    def forward(x):
        everyone = torch.empty(ep * x.shape[0], x.shape[1])
        comm.all_to_all(everyone, x.repeat(ep, 1), group=group)
        r = moe.decide(everyone)
        partial = torch.zeros_like(everyone)
        for j in range(moe.top_k):
            for e in range(rank * per, (rank + 1) * per):
                m = r.idx[:, j] == e
                partial[m] += r.gates[m, j, None] * moe.experts[e](everyone[m])
        back = torch.empty_like(everyone)
        comm.all_to_all(back, partial, group=group)
        return back.view(ep, *x.shape).sum(0)
    return forward


def moe_nan(moe, group):
    """The chapter's layer, then NaN added (any NaN-making bug): NaN compares false."""
    layer = dispatch.reference(moe, group)
    return lambda x: layer(x) + float("nan")


def test_dispatch_refuses_nan():
    _refused(dispatch.grade(moe_nan), "rank 0's output token 0 (experts", "is NaN",
             "a NaN is never a rounding error")


def test_dispatch_passes_chapter_7s_expert_parallel_moe():
    assert "expert 0 got 16 of 32 rows" in _passes(dispatch.grade(dispatch.reference))


def test_dispatch_passes_a_hand_written_layer():
    _passes(dispatch.grade(moe_hand))


def test_dispatch_refuses_a_combine_that_drops_the_over_full_experts_rows():
    _refused(dispatch.grade(moe_combine_drops_overfull), "rank 0's token 4", "lacks expert 0's output",
             "expert 0 received 16 rows, more than an even share (8)")


def test_dispatch_refuses_rows_sent_in_token_order():
    _refused(dispatch.grade(moe_unsorted_dispatch), "rank 0's token 0 differs", "sort each rank's")


def test_dispatch_refuses_every_token_to_every_rank_by_its_bytes():
    _refused(dispatch.grade(moe_every_token_everywhere), "rank 0 sent 512 bytes",
             "64 bytes more than the routed rows")


# ---- puzzle 2: DDP with buckets and no_sync --------------------------------------------------

class _HandDDP:
    """A reader's DDP (the notebook's solution), a switch per mistake."""

    def __init__(self, model, cap, average=True, obey_no_sync=True, eager=False, at_end=False, nan=False):
        self.n, self.sync, self.nan = dist.get_world_size(), True, nan
        self.average, self.obey, self.eager, self.at_end = average, obey_no_sync, eager, at_end
        self.buckets, size = [[]], 0
        for p in reversed(list(model.parameters())):
            if size >= cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += 4 * p.numel()
        self.ready = {id(p): 0 for p in model.parameters()}
        self.bucket_of = {id(p): b for b in self.buckets for p in b}
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.hook)

    def hook(self, p):
        if not self.sync and self.obey:
            return
        bucket = self.bucket_of[id(p)]
        self.ready[id(p)] = 1
        if self.at_end:  # every bucket waits for the last gradient of the whole backward
            if all(self.ready.values()):
                for b in self.buckets:
                    flat = torch.cat([q.grad.reshape(-1) for q in b]) / self.n
                    comm.all_reduce(flat)
                    for q, g in zip(b, flat.split([q.numel() for q in b])):
                        q.grad.copy_(g.view_as(q))
                self.ready = dict.fromkeys(self.ready, 0)
            return
        done = sum(self.ready[id(q)] for q in bucket)
        if done == (1 if self.eager else len(bucket)):
            flat = torch.cat([q.grad.reshape(-1) if q.grad is not None else torch.zeros(q.numel())
                              for q in bucket])
            comm.all_reduce(flat)
            if self.average:
                flat /= self.n
            if self.nan:
                flat[0] = float("nan")
            for q, g in zip(bucket, flat.split([q.numel() for q in bucket])):
                if q.grad is not None:
                    q.grad.copy_(g.view_as(q))
        if done == len(bucket):
            for q in bucket:
                self.ready[id(q)] = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


def ddp_hand(model, cap):
    return _HandDDP(model, cap)


def ddp_summed(model, cap):
    return _HandDDP(model, cap, average=False)


def ddp_ignores_no_sync(model, cap):
    return _HandDDP(model, cap, obey_no_sync=False)


def ddp_bucket_too_early(model, cap):
    """A bucket all-reduced as soon as its first gradient is ready."""
    return _HandDDP(model, cap, eager=True)


def ddp_buckets_at_end(model, cap):
    """The right buckets, all launched when the last gradient is ready: nothing overlaps backward."""
    return _HandDDP(model, cap, at_end=True)


def ddp_one_bucket_at_end(model, bucket_cap_bytes):
    """The referee's: no buckets, one all-reduce of every gradient when the last hook fires."""
    n, sync = dist.get_world_size(), [True]
    params = list(model.parameters())
    seen = set()

    def hook(p):
        if not sync[0]:
            return
        seen.add(id(p))
        if len(seen) == len(params):
            seen.clear()
            flat = torch.cat([q.grad.reshape(-1) for q in params]) / n
            comm.all_reduce(flat)
            for q, g in zip(params, flat.split([q.numel() for q in params])):
                q.grad.copy_(g.view_as(q))

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    @contextlib.contextmanager
    def no_sync():
        sync[0] = False
        try:
            yield
        finally:
            sync[0] = True

    return types.SimpleNamespace(no_sync=no_sync)


def test_ddp_refuses_one_all_reduce_for_every_bucket():
    _refused(ddp.grade(ddp_one_bucket_at_end), "made 1 all-reduce(s)",
             "make 2: 2.bias, 2.weight, 0.bias; 0.weight", "reverse parameter order")


def test_ddp_refuses_buckets_that_wait_for_the_end_of_backward():
    _refused(ddp.grade(ddp_buckets_at_end), "started no all-reduce before its last gradient (0.weight)",
             "no communication overlaps it", "from the hook of its last gradient")


def ddp_never_resets(model, bucket_cap_bytes):
    """The referee's: bucket counters that count down and are never re-armed: right for the first
    synced backward only; the second sends nothing."""
    n, sync = dist.get_world_size(), [True]
    buckets, size = [[]], 0
    for p in reversed(list(model.parameters())):
        if size >= bucket_cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
    pending = [len(b) for b in buckets]

    def hook(p):
        if not sync[0]:
            return
        i = bucket_of[id(p)]
        pending[i] -= 1
        if pending[i] == 0:
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[i]]) / n
            comm.all_reduce(flat)
            for q, g in zip(buckets[i], flat.split([q.numel() for q in buckets[i]])):
                q.grad.copy_(g.view_as(q))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    @contextlib.contextmanager
    def no_sync():
        sync[0] = False
        try:
            yield
        finally:
            sync[0] = True
    return types.SimpleNamespace(no_sync=no_sync)


def test_ddp_refuses_counters_never_rearmed_at_the_second_synced_backward():
    _refused(ddp.grade(ddp_never_resets), "after the second synced backward", "differs from one process",
             "re-arm its count of ready gradients")


def ddp_nan(model, cap):
    return _HandDDP(model, cap, nan=True)


def test_ddp_names_a_nan():
    _refused(ddp.grade(ddp_nan), "rank 0's gradient of 0.weight element 0 is NaN",
             "a softmax over a row that is all -inf")


def test_ddp_passes_chapter_2s_hand_ddp():
    text = _passes(ddp.grade(ddp.reference))
    assert "(bitwise)" in text and "= 176 per rank" in text and "in 2 all-reduce(s)" in text


def test_ddp_passes_a_hand_written_hook():
    _passes(ddp.grade(ddp_hand))


def test_ddp_refuses_the_sum_for_the_average():
    _refused(ddp.grade(ddp_summed), "rank 0's gradient of", "N = 2 times the average")


def test_ddp_refuses_communicating_under_no_sync():
    _refused(ddp.grade(ddp_ignores_no_sync), "rank 0 sent 176 bytes inside no_sync", "176 bytes too many")


def test_ddp_refuses_a_bucket_reduced_before_its_gradients_are_ready():
    _refused(ddp.grade(ddp_bucket_too_early), "rank 0's gradient of 0.bias", "off by",
             "launch it when the last of them is ready")


# ---- puzzle 4: an FSDP unit ------------------------------------------------------------------

def _fsdp_unit(module, free=True, regather=True, all_reduce=False, free_after_backward=True):
    """A reader's FSDP unit (the notebook's solution), a switch per mistake."""
    n, r = dist.get_world_size(), dist.get_rank()
    names, params = list(module._parameters), list(module._parameters.values())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    k = flat.numel() // n
    shard = torch.nn.Parameter(flat[r * k:(r + 1) * k].clone())
    full = torch.empty_like(flat)
    pieces = full.split([p.numel() for p in params])
    views = [torch.nn.Parameter(t.view_as(p)) for t, p in zip(pieces, params)]
    for name, v in zip(names, views):
        module._parameters[name] = v

    def gather(*_):
        full.untyped_storage().resize_(4 * full.numel())
        comm.all_gather(full.data, shard.detach())

    def release():
        if free:
            full.untyped_storage().resize_(0)

    def after_forward(m, args, out):
        release()
        if regather:
            out.register_hook(gather)

    ready = []

    def grad_ready(p):
        ready.append(p)
        if len(ready) == len(views):
            ready.clear()
            g = torch.cat([v.grad.reshape(-1) for v in views])
            for v in views:
                v.grad = None
            if all_reduce:
                comm.all_reduce(g)
                shard.grad = g[r * k:(r + 1) * k] / n
            else:
                out = torch.empty(k)
                comm.reduce_scatter(out, g)
                shard.grad = out / n
            if free_after_backward:
                release()

    release()
    module.register_forward_pre_hook(gather)
    module.register_forward_hook(after_forward)
    for v in views:
        v.register_post_accumulate_grad_hook(grad_ready)
    return [shard]


def fsdp_hand(module):
    return _fsdp_unit(module)


def fsdp_freed_before_backward(module):
    return _fsdp_unit(module, regather=False)


def fsdp_never_freed(module):
    return _fsdp_unit(module, free=False)


def fsdp_all_reduce(module):
    return _fsdp_unit(module, all_reduce=True)


def test_fsdp_passes_chapter_3s_hand_fsdp():
    _passes(fsdp.grade(fsdp.reference))


def test_fsdp_passes_a_hand_written_unit():
    _passes(fsdp.grade(fsdp_hand))


def test_fsdp_refuses_weights_freed_before_backward():
    _refused(fsdp.grade(fsdp_freed_before_backward), "storage of size 0", "gather them again")


def test_fsdp_refuses_weights_never_freed_by_the_peak():
    # it holds the other unit's weights too, 4 x 136 = 544 bytes, 256 more than the message buffer's
    # allowance (288): storages are counted, so the margin is the same on every run
    _refused(fsdp.grade(fsdp_never_freed), "at its peak in forward", "256 bytes too many")


def fsdp_keeps_after_backward(module):
    """The referee's: freed after forward, but the full weights stay gathered after backward."""
    return _fsdp_unit(module, free_after_backward=False)


def test_fsdp_refuses_full_weights_kept_after_backward():
    _refused(fsdp.grade(fsdp_keeps_after_backward), "holds 1,120 bytes after backward",
             "4 Psi_u = 576 + 544, are still gathered", "832 bytes too many", "keeps only the shard")


def test_fsdp_refuses_an_all_reduce_for_the_reduce_scatter():
    _refused(fsdp.grade(fsdp_all_reduce), "in backward", "bytes too many", "reduce-scatter the gradients")


# ---- puzzle 7: ring attention ----------------------------------------------------------------

def _ring_attention(q, k, v, shift=0, renormalise=True, rotate=True, later=False):
    """A reader's ring attention (the notebook's solution), a switch per mistake."""
    n, r = dist.get_world_size(), dist.get_rank()
    t, scale = q.shape[0], q.shape[1] ** -0.5
    out, lse = torch.zeros_like(q), torch.full((t,), float("-inf"))
    diag = torch.ones(t, t, dtype=torch.bool).tril()
    for s in range(n):
        owner = (r - s) % n
        if s < n - 1 and rotate:  # the next block is on its way while this one is used
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            reqs = [comm.isend(k, (r + 1) % n), comm.isend(v, (r + 1) % n),
                    comm.irecv(k_next, (r - 1) % n), comm.irecv(v_next, (r - 1) % n)]
        if (owner <= r + shift or later) and (rotate or s == 0):
            scores = q @ k.T * scale
            if owner == r + shift:
                scores = scores.masked_fill(~diag, float("-inf"))
            block_lse = torch.logsumexp(scores, -1)
            o = torch.softmax(scores, -1) @ v
            if renormalise:
                new = torch.logaddexp(lse, block_lse)
                out = out * torch.exp(lse - new)[:, None] + o * torch.exp(block_lse - new)[:, None]
                lse = new
            else:
                out = out + o
        if s < n - 1 and rotate:
            for q_ in reqs:
                q_.wait()
            k, v = k_next, v_next
    return out


def ring_attention_hand(q, k, v):
    return _ring_attention(q, k, v)


def ring_attention_mask_one_block_ahead(q, k, v):
    return _ring_attention(q, k, v, shift=1)


def ring_attention_no_renormalisation(q, k, v):
    return _ring_attention(q, k, v, renormalise=False)


def ring_attention_no_rotation(q, k, v):
    return _ring_attention(q, k, v, rotate=False)


def ring_attention_later_blocks(q, k, v):
    """A later rank's block attended to, whole: the learner's first wrong version."""
    return _ring_attention(q, k, v, later=True)


def ring_attention_own_block_only(q, k, v):
    """K/V received, but the rank's own k and v used at every step: the learner's second."""
    n, r = dist.get_world_size(), dist.get_rank()
    t, scale = q.shape[0], q.shape[1] ** -0.5
    out, lse = torch.zeros_like(q), torch.full((t,), float("-inf"))
    diag = torch.ones(t, t, dtype=torch.bool).tril()
    held = (k, v)
    for s in range(n):
        owner = (r - s) % n
        if s < n - 1:
            nxt = (torch.empty_like(k), torch.empty_like(v))
            reqs = [comm.isend(held[0], (r + 1) % n), comm.isend(held[1], (r + 1) % n),
                    comm.irecv(nxt[0], (r - 1) % n), comm.irecv(nxt[1], (r - 1) % n)]
        if owner <= r:
            scores = q @ k.T * scale
            if owner == r:
                scores = scores.masked_fill(~diag, float("-inf"))
            block_lse = torch.logsumexp(scores, -1)
            new = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - new)[:, None] + (torch.softmax(scores, -1) @ v) * torch.exp(
                block_lse - new)[:, None]
            lse = new
        if s < n - 1:
            for x in reqs:
                x.wait()
            held = nxt
    return out


def ring_attention_masks_future_with_inf(q, k, v):
    """The referee's: a later rank's block masked whole with -inf instead of skipped: NaN rows."""
    n, r = dist.get_world_size(), dist.get_rank()
    t = q.shape[0]
    ks = [k]
    for s in range(n - 1):  # the right ring's blocks, gathered one per step
        nxt = (torch.empty_like(k), torch.empty_like(v))
        reqs = [comm.isend(ks[-1], (r + 1) % n), comm.irecv(nxt[0], (r - 1) % n)]
        for x in reqs:
            x.wait()
        ks.append(nxt[0])
    scores = q @ ks[0].T * q.shape[1] ** -0.5
    if r < n - 1:
        scores = torch.full((t, t), float("-inf"))
    return torch.softmax(scores, -1) @ v


def ring_attention_returns_none(q, k, v):
    """The referee's: forgets the return."""
    torch.softmax(q @ k.T, -1) @ v


def test_ring_attention_names_a_later_block_attended():
    _refused(ring_attn.grade(ring_attention_later_blocks), "rank 0's output row",
             "it attends to keys of later ranks' blocks", "skip it")


def test_ring_attention_names_kv_received_but_unused():
    _refused(ring_attn.grade(ring_attention_own_block_only), "rank 1's output row",
             "received K/V but used its own block", "k, v = k_next, v_next")


def test_ring_attention_refuses_nan_rows():
    _refused(ring_attn.grade(ring_attention_masks_future_with_inf), "rank 0's output row 0 (query position 0)"
             " is NaN in every column, as a softmax over keys that are all masked",
             "instead of masking all of it")


def ring_attention_allgather(q, k, v):
    """The referee's: K and V sent straight to every rank, full causal attention at once."""
    n, r = dist.get_world_size(), dist.get_rank()
    t = q.shape[0]
    ks, vs = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in range(n)]
    ks[r], vs[r] = k, v
    reqs = []
    for j in range(n):
        if j != r:
            reqs += [comm.isend(k, j), comm.isend(v, j), comm.irecv(ks[j], j), comm.irecv(vs[j], j)]
    for x in reqs:
        x.wait()
    rows, cols = torch.arange(r * t, r * t + t)[:, None], torch.arange(n * t)[None, :]
    s = (q @ torch.cat(ks).T) * q.shape[1] ** -0.5
    return torch.softmax(s.masked_fill(cols > rows, float("-inf")), -1) @ torch.cat(vs)


def test_ring_attention_refuses_kv_sent_to_every_rank_by_its_peers():
    _refused(ring_attn.grade(ring_attention_allgather),
             "rank 0's message 3 (recv, 128 bytes) came from rank 1", "only to r + 1 = 1",
             "holds two at a time")


def test_ring_attention_refuses_none():
    _refused(ring_attn.grade(ring_attention_returns_none), "returned None on rank 0", "return the result")


def test_ring_attention_passes_chapter_6s_ring_attention():
    assert "= 512, counted" in _passes(ring_attn.grade(ring_attn.reference))


def test_ring_attention_passes_a_hand_written_ring():
    _passes(ring_attn.grade(ring_attention_hand))


def test_ring_attention_refuses_a_mask_off_by_one_block():
    _refused(ring_attn.grade(ring_attention_mask_one_block_ahead), "rank 0's output row 0",
             "it sees one block ahead", "off by one block")


def test_ring_attention_refuses_blocks_summed_without_renormalising():
    _refused(ring_attn.grade(ring_attention_no_renormalisation), "rank 1's output row",
             "without renormalising", "keep the log-sum-exp")


def test_ring_attention_refuses_kv_never_rotated():
    _refused(ring_attn.grade(ring_attention_no_rotation), "rank 1's output row",
             "only its own K/V block", "pass the block you hold")
