"""Chapter 15: an MoE layer's all-to-all hidden under another micro-batch's compute, by hand.

DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437, section 3.2.1) pairs two micro-batches' chunks
so that one computes while the other's dispatch or combine all-to-all is on the wire (DualPipe's
overlap of computation and communication). The idea on two micro-batches, A and B, of a layer made
of a dense part (the attention's stand-in: a two-matmul MLP) and chapter 7's expert-parallel MoE
(`labs.expert_parallel.moe.ExpertParallelMoE`), forward only:

    one after the other:  dense A | a2a A | experts A | a2a A | dense B | a2a B | experts B | a2a B
    overlapped:           dense A | dense B | experts A | experts B | (A's combine, B's combine)
                          with A's dispatch under dense B, B's dispatch under experts A and
                          A's combine under experts B

Every all-to-all is issued with ``async_op=True`` and waited on just before its result is needed.
Each micro-batch runs the same operations in the same order either way, and the same as chapter
7's layer does, so the outputs are equal bit for bit (`check`).
"""
import torch
import torch.nn as nn
from torch.profiler import record_function

from labs.expert_parallel.moe import ExpertParallelMoE, MoE
from labs.launcher import launch
from labs.measure import comm


class Layer(nn.Module):
    """A dense MLP (hidden -> inner -> hidden, the compute that can hide an all-to-all), then the MoE."""

    def __init__(self, hidden, inner, experts, top_k, ffn, group=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.dense = nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden))
        self.moe = ExpertParallelMoE(MoE(hidden, experts, top_k, None, ffn, seed=seed + 1), group)

    def start(self, x):
        """Dense part, routing, split sizes (a small synchronous all-to-all), dispatch issued."""
        moe = self.moe
        with record_function("moe:dense"):   # named for the trace's order check (chapter 15)
            h = self.dense(x)
        r = moe.decide(h)
        t, slot = r.keep.nonzero(as_tuple=True)
        e = r.idx[t, slot]
        o = moe.order(e)
        t, slot, e = t[o], slot[o], e[o]
        counts = torch.bincount(e, minlength=moe.num_experts)
        recv = torch.empty_like(counts)
        comm.all_to_all(recv, counts, group=moe.group)
        send = counts.view(moe.ep, moe.per).sum(1).tolist()
        got = recv.view(moe.ep, moe.per).sum(1).tolist()
        rows = h.new_empty((sum(got), h.size(1)))
        work = comm.all_to_all(rows, h[t].contiguous(), group=moe.group, async_op=True,
                               output_split_sizes=got, input_split_sizes=send)
        return {"h": h, "r": r, "t": t, "slot": slot, "recv": recv, "send": send, "got": got,
                "rows": rows, "work": work}

    def experts(self, s):
        """Wait for the dispatch, run the local experts, issue the combine."""
        moe = self.moe
        with record_function("moe:dispatch wait"):
            s["work"].wait()
        experts = torch.arange(moe.per, device=s["recv"].device).repeat(moe.ep)
        local = torch.repeat_interleave(experts, s["recv"])
        y = moe.run_experts(s["rows"], local)
        s["back"] = y.new_empty((sum(s["send"]), y.size(1)))
        s["work"] = comm.all_to_all(s["back"], y, group=moe.group, async_op=True,
                                    output_split_sizes=s["send"], input_split_sizes=s["got"])
        return s

    def finish(self, s):
        """Wait for the combine; weight the experts' outputs by their gates and add the residual."""
        s["work"].wait()
        r, t, slot, h = s["r"], s["t"], s["slot"], s["h"]
        out = torch.zeros_like(h).index_add(0, t, r.gates[t, slot, None] * s["back"])
        return h + out

    @torch.no_grad()
    def sequential(self, a, b):
        return [self.finish(self.experts(self.start(x))) for x in (a, b)]

    @torch.no_grad()
    def overlapped(self, a, b):
        sa = self.start(a)
        sb = self.start(b)          # dense B while A's dispatch is on the wire
        self.experts(sa)            # experts A while B's dispatch is on the wire
        self.experts(sb)            # experts B while A's combine is on the wire
        return [self.finish(sa), self.finish(sb)]


def shapes(small=False):
    """Sizes: a dispatch of T k rows of h floats, of which half leave the rank at ep = 2, against
    dense and expert matmuls of similar duration on one CPU thread. ``small``: for equality checks."""
    if small:
        return {"tokens": 32, "hidden": 16, "inner": 32, "experts": 4, "top_k": 2, "ffn": 8}
    return {"tokens": 512, "hidden": 1024, "inner": 256, "experts": 4, "top_k": 2, "ffn": 128}


def _micro_batches(rank, tokens, hidden):
    g, dev = torch.Generator().manual_seed(100 + rank), launch.device()
    return torch.randn(tokens, hidden, generator=g).to(dev), torch.randn(tokens, hidden, generator=g).to(dev)


def check(rank, world_size, small=True):
    """Both schedules, and chapter 7's layer on the dense output, give the same outputs bit for bit."""
    s = shapes(small)
    layer = Layer(s["hidden"], s["inner"], s["experts"], s["top_k"], s["ffn"]).to(launch.device())
    a, b = _micro_batches(rank, s["tokens"], s["hidden"])
    seq, ovl = layer.sequential(a, b), layer.overlapped(a, b)
    with torch.no_grad():
        ref = [layer.moe(layer.dense(x)) for x in (a, b)]
    return {"overlapped_equals_sequential": all(torch.equal(x, y) for x, y in zip(seq, ovl)),
            "equals_chapter_7": all(torch.equal(x, y) for x, y in zip(seq, ref)),
            "max_abs_diff": max((x - y).abs().max().item() for x, y in zip(seq, ovl))}


def steps(rank, world_size, calls=2):
    """The two schedules as profiled steps: "a" overlapped, "b" one after the other."""
    s = shapes()
    layer = Layer(s["hidden"], s["inner"], s["experts"], s["top_k"], s["ffn"]).to(launch.device())
    a, b = _micro_batches(rank, s["tokens"], s["hidden"])

    def repeat(fn):
        def step():
            for _ in range(calls):
                fn(a, b)
        return step
    return {"a": repeat(layer.overlapped), "b": repeat(layer.sequential)}
