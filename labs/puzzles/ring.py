"""Chapter 16, puzzle 1 (chapter 2 teaches it): a ring all-reduce from point-to-point messages.

The reader writes ``ring_allreduce(tensor)``: sum ``tensor`` over all ranks, in place, using only
``comm.send``, ``comm.recv``, ``comm.isend`` and ``comm.irecv`` (the book's counted wrappers of
torch.distributed's; every message is counted as it is posted, with its peer). The reference is
chapter 2's `labs.data_parallel.hand_ring.ring_allreduce`. The grader's buffer, 13 elements on 3
ranks, does not divide evenly: the chunks are `comm.ring_chunks` (5, 4, 4), so a ring that assumes
equal chunks (``tensor.view(N, -1)``) fails.

Checked on every rank:
- the result against one process's float64 sum of all ranks' inputs. The ring adds chunk k's N
  inputs in a different order from one process, so it is not bitwise equal for N > 2; the bound
  is the classic one for a sum of N floats (Higham 2002, section 4.2): gamma_(N-1) sum_i |x_i|,
  gamma_k = k u / (1 - k u), u = 2^-24 in fp32, which is (N - 1) u sum_i |x_i| to first order.
  A NaN is named as a NaN (`grader.nan_in`). Every rank must also hold the same bits (the
  all-gather copies, never adds);
- the bytes it sent against the ring's: rank r sends every chunk but its own in the
  reduce-scatter and every chunk but its right neighbour's in the all-gather,
  2M - chunk_r - chunk_(r+1) bytes (`labs.measure.comm.ring_allreduce_elements`), 2(N-1)/N M when
  N divides the buffer (`labs.formulas.costs`);
- the ring itself, checked before the bytes: every message rank r sends goes to rank r + 1 and
  every one it receives comes from rank r - 1 (the peers `comm` logs). A direct all-reduce, each
  chunk sent straight to its owner and the sums straight back, sends about the ring's bytes per
  rank (exactly when N divides the buffer) but talks to N - 1 peers; the first message that leaves
  the ring is named.
"""
import torch

from labs.formulas import costs
from labs.measure import comm, report
from labs.puzzles import grader

HINT_HANG = ("a ring where every rank first waits to receive never starts: post the send and the "
             "receive together (comm.isend and comm.irecv, then wait on both).")


def rank_input(rank, numel):
    g = torch.Generator().manual_seed(2024 + rank)
    return torch.randn(numel, generator=g)


def check(rank, world_size, fn, numel):
    """On one rank: run the reader's all-reduce on this rank's input, count its messages."""
    x = rank_input(rank, numel)
    with comm.counting() as tally:
        fn(x)
    return {"result": x, "bytes_sent": tally.bytes_sent, "messages": tally.calls("send"),
            "log": tally.messages}


def grade(fn, world_size=3, numel=13, deadline=10.0):
    """Run ``fn`` on ``world_size`` gloo ranks and compare with one process and the ring's bytes."""
    results = grader.run(check, fn, world_size, deadline, HINT_HANG, numel=numel)
    if isinstance(results, grader.Grade):
        return results
    inputs = [rank_input(r, numel).double() for r in range(world_size)]
    exact = sum(inputs)
    ku = (world_size - 1) * 2.0**-24
    bound = ku / (1 - ku) * sum(x.abs() for x in inputs) + 1e-30  # gamma_(N-1) sum |x|
    chunks = comm.ring_chunks(numel, world_size)
    starts = [sum(chunks[:k]) for k in range(world_size)]
    for r, out in enumerate(results):
        if torch.equal(out["result"], rank_input(r, numel)):
            return grader.Grade(False, [f"rank {r}'s input tensor was not changed: the all-reduce sums "
                                        "into it, in place"],
                                "add the arriving chunks into views of tensor itself (tensor.split gives "
                                "views); a result returned or summed in a copy is lost.")
    for r, out in enumerate(results):
        nan = grader.nan_in(r, "result", out["result"])
        if nan:
            return nan
        err = (out["result"].double() - exact).abs()
        if grader.exceeds(err, bound).any():
            i = grader.worst(err, bound)
            k = max(j for j in range(world_size) if starts[j] <= i)
            value = f"{out['result'][i].item():.4g}"
            return grader.Grade(False, [
                f"rank {r} holds the wrong sum in chunk {k} "
                f"(elements {starts[k]}..{starts[k] + chunks[k] - 1}): "
                f"element {i} is {value}, one process says {exact[i].item():.4g}"],
                _hint_wrong(out["result"], inputs, k, starts[k], chunks[k]))
    for r, out in enumerate(results[1:], 1):
        if not torch.equal(out["result"], results[0]["result"]):
            return grader.Grade(False, [f"rank {r} and rank 0 hold different bits: an all-reduce leaves "
                                        "every rank with the same result"],
                                "let the all-gather copy the reduced chunks; adding them again on each "
                                "rank rounds differently.")
    want = [comm.ring_allreduce_elements(numel, world_size, r) * 4 for r in range(world_size)]
    for r, out in enumerate(results):  # the ring first: a direct all-reduce's bytes differ by rounding only
        right, left = (r + 1) % world_size, (r - 1) % world_size
        for j, (kind, peer, nbytes) in enumerate(out["log"]):
            if peer != (right if kind == "send" else left):
                way = f"went to rank {peer}" if kind == "send" else f"came from rank {peer}"
                more = out["bytes_sent"] - want[r]
                return grader.Grade(False, [
                    f"rank {r}'s message {j + 1} ({kind}, {nbytes} bytes) {way}: in a ring rank r sends "
                    f"only to r + 1 = {right} and receives only from r - 1 = {left}"
                    + (f"; it sent {out['bytes_sent']:,} bytes, the ring {want[r]:,}" if more else "")],
                    "sending the whole buffer to one rank is the naive all-reduce, whose busiest link "
                    "carries (N-1) M; pass one chunk (1/N of it) per step to the right neighbour."
                    if any(b == 4 * numel for *_, b in out["log"]) else
                    "pass one chunk per step to the right neighbour: sending each chunk straight to its "
                    "owner moves about the same bytes per rank, but every rank talks to N - 1 peers at "
                    "once (a direct all-reduce, not a ring).")
    for r, out in enumerate(results):
        if out["bytes_sent"] != want[r]:
            more = out["bytes_sent"] - want[r]
            word = "too many" if more > 0 else "too few"
            return grader.Grade(False, [
                f"rank {r} sent {out['bytes_sent']:,} bytes in {out['messages']} messages; the ring "
                f"sends {want[r]:,}: {abs(more):,} bytes {word}"],
                "each rank sends one chunk (1/N of the buffer) per step, 2(N-1) steps in all."
                if more > 0 else "count the steps: N-1 to reduce-scatter, N-1 to all-gather.")
    worst = max((o["result"].double() - exact).abs().max().item() for o in results)
    m = numel * 4
    formula = (f"2(N-1)/N M = {costs.sent('all_reduce', m, world_size):,} bytes" if numel % world_size == 0
               else f"2M - chunk_r - chunk_(r+1) = {', '.join(f'{w:,}' for w in want)} bytes")
    return grader.Grade(True, [
        f"ring all-reduce of {numel} fp32 elements on {world_size} ranks",
        f"result: one process's sum within gamma_(N-1) sum|x| on every rank (largest error "
        f"{report.below(worst, 1e-5)}), the same bits on every rank",
        f"bytes sent per rank: {formula}, counted message by message, each to rank r + 1"])


def _hint_wrong(result, inputs, k, start, size):
    """Which inputs chunk k of the result actually holds, when it is a sum of some of them."""
    got = result[start:start + size].double()
    n = len(inputs)
    for mask in range(1, 2**n):
        part = sum(inputs[j][start:start + size] for j in range(n) if mask >> j & 1)
        if torch.allclose(got, part, atol=1e-5):
            ranks = [j for j in range(n) if mask >> j & 1]
            return (f"chunk {k} holds the sum of ranks {ranks} only: in reduce-scatter step s rank r "
                    f"sends chunk (r - 1 - s) mod N, and the chunk that arrives from its left is added "
                    f"into its own chunk (r - 2 - s) mod N.")
    return ("check the chunk indices: in reduce-scatter step s rank r sends chunk (r - 1 - s) mod N; "
            "in all-gather step s it sends chunk (r - s) mod N.")
