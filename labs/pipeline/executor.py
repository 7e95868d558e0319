"""Chapter 5: one executor that runs any schedule of `labs.formulas.schedules` with real sends and receives.

The tiny GPT (24 layers) is cut into p*v pieces; piece k runs on rank k mod p as its chunk k // p.
Each rank walks its own list of actions. F receives an activation from the previous piece (or
embeds tokens), runs, and sends its output on; B receives the output's gradient from the next
piece, backpropagates, and sends the input's gradient back. Under a split backward (ZB-H1) B
computes all but the linear layers' weight gradients and leaves each linear layer's input and
output gradient in a store; W computes the weight gradients from that store, nothing recomputed
(`labs.pipeline.split_backward`).

Two clocks are measured. Every message carries a logical clock: an action starts when both its
rank and its message are ready and lasts its work units (F = 1, B = 2; split, F = B = W = 1), so
the executed timeline gives the bubble in work units. And every action is padded with a sleep to
a fixed wall-clock duration per unit, so the real timeline gives it in seconds.

Activation memory is measured, not inferred from a count of micro-batches: after every action the
executor adds up the storages that autograd still holds for backward and those waiting in W stores
(`split_backward.Activations`), and reports each stage's peak in bytes. Under 1F1B stage 0 holds
p micro-batches of L/p layers each: L layers' worth of activations, whatever p is.
The same pieces under PyTorch's own schedules: `labs.pipeline.torch_pipelining`.

    python -m labs.pipeline.executor --world-size 4 --schedule 1f1b --microbatches 8 --json
"""
import contextlib
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from labs.measure import comm
from labs.launcher import launch
from labs import model as tiny
from labs.formulas import schedules
from labs.pipeline import split_backward

TAGS = {"F": 0, "B": 1}
_REFERENCE = {}  # (m, batch size) -> reference_grads: a sweep would redo the whole model per run


def config():
    """24 tiny layers: p*v = 2, 3, 4, 6 and 8 pieces all divide them."""
    return tiny.GPTConfig(n_layer=24)


class Piece(nn.Module):
    """Layers [lo, hi) of a GPT; the first piece also embeds, the last also computes the loss."""

    def __init__(self, net, lo, hi):
        super().__init__()
        self.first, self.last = lo == 0, hi == len(net.blocks)
        self.blocks = nn.ModuleList(net.blocks[lo:hi])
        self.tok_emb, self.pos_emb = (net.tok_emb, net.pos_emb) if self.first else (None, None)
        self.ln_f, self.head = (net.ln_f, net.head) if self.last else (None, None)
        own = {id(q) for q in self.parameters()}
        self.named = [(n, q) for n, q in net.named_parameters() if id(q) in own]  # global names

    def forward(self, x, targets=None):
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            x = block(x)
        if not self.last:
            return x                                                        # (B, T, H)
        logits = self.head(self.ln_f(x))                                    # (B, T, V)
        return logits if targets is None else cross_entropy(logits, targets)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def split(net, pieces):
    n = len(net.blocks)
    if n % pieces:
        raise ValueError(f"{n} layers do not split into p*v = {pieces} equal pieces; "
                         "choose p and v whose product divides the layer count.")
    size = n // pieces
    return [Piece(net, k * size, (k + 1) * size) for k in range(pieces)]


class Executor:
    """Runs one rank's action list; records logical and wall-clock timelines and activation bytes."""

    def __init__(self, pieces, rank, p, v, cost, unit_seconds, data, m, hidden, split_bw=False, lock=None):
        self.pieces, self.rank, self.p, self.v, self.hidden, self.lock = pieces, rank, p, v, hidden, lock
        self.cost, self.unit, self.data, self.m, self.split_bw = cost, unit_seconds, data, m, split_bw
        self.activations = split_backward.Activations(pieces)
        self.saved, self.pending, self.events = {}, [], []  # saved: (mb, chunk) -> what B and W need
        self.clock, self.peak, self.peak_bytes, self.message_bytes = 0.0, 0, 0, 0

    def _tag(self, kind, mb, k):
        return (TAGS[kind] * self.m + mb) * self.p * self.v + k

    def _send(self, t, dst, tag, clock):
        payload = torch.cat([t.detach().reshape(-1).float(), torch.tensor([clock])])
        self.message_bytes = t.numel() * t.element_size()
        self.pending.append(comm.isend(payload, dst, tag=tag))

    def _recv(self, shape, src, tag):
        buf = torch.empty(int(torch.tensor(shape).prod()) + 1)
        comm.irecv(buf, src, tag=tag).wait()
        self.wall0 = time.perf_counter()  # waiting for the message is bubble, not work
        # a copy without the clock: what the stage then holds is the activation (or gradient) alone
        return buf[:-1].view(shape).clone(), buf[-1].item()

    def run(self, actions):
        for a in actions:
            k = a.chunk * self.p + self.rank
            self.wall0 = time.perf_counter()
            ready = getattr(self, "_" + a.kind)(a, k)  # sets self.wall0 again once its message is in
            wall0 = self.wall0
            start = max(self.clock, ready)
            self.clock = start + self.cost[a.kind]
            # pad to a fixed duration per work unit (compute made uniform and dominant), then send:
            # the next stage gets its message when this action's work is done
            worked = time.perf_counter() - wall0
            if self.lock:  # the planted bug of `wall_clock`: every stage's padded work under one lock
                self.lock.acquire()
                wall0, worked = time.perf_counter(), 0.0
            time.sleep(max(0.0, self.cost[a.kind] * self.unit - worked))
            wall1 = time.perf_counter()
            if self.lock:
                self.lock.release()
            # busy: the schedule's nominal work, the padding target. Compute past the padding or a
            # sleep's overshoot (load) lengthens the action on the wall but is not counted as work
            work = self.cost[a.kind] * self.unit
            self._finish_message(a, k)
            held = self.activations.held_bytes([e["store"] for e in self.saved.values()])
            self.events.append({"action": repr(a), "start": start, "end": self.clock,
                                "wall_start": wall0, "wall_end": wall1, "wall_work": work,
                                "activation_bytes": held})
            self.peak = max(self.peak, len(self.saved))
            self.peak_bytes = max(self.peak_bytes, held)
        for req in self.pending:
            req.wait()

    def _F(self, a, k):
        x, y = self.data[a.mb]
        ready = 0.0
        if k > 0:
            x, ready = self._recv((*x.shape, self.hidden), (k - 1) % self.p, self._tag("F", a.mb, k - 1))
            x.requires_grad_()
        piece, store = self.pieces[a.chunk], []     # store: W's inputs, filled by a split B
        deferring = split_backward.deferring(piece, store) if self.split_bw else contextlib.nullcontext()
        with self.activations.saving(), deferring:
            out = piece(x, y)
        if k == self.p * self.v - 1:
            out = out / self.m  # the mean over micro-batches, as one big batch would take
        self.saved[(a.mb, a.chunk)] = {"x": x, "out": out, "store": store}
        return ready

    def _B(self, a, k):
        entry = self.saved[(a.mb, a.chunk)]
        grad, ready = None, self.clock
        if k < self.p * self.v - 1:
            grad, ready = self._recv(entry["out"].shape, (k + 1) % self.p, self._tag("B", a.mb, k + 1))
        # The whole backward or, split, all but the linear layers' weight gradients. No retain_graph:
        # autograd frees this micro-batch's saved activations as it goes; W needs only the store.
        torch.autograd.backward(entry.pop("out"), grad)
        self._last_input = entry.pop("x")
        if not self.split_bw:
            del self.saved[(a.mb, a.chunk)]
        return ready

    def _W(self, a, k):
        split_backward.weight_grads(self.saved.pop((a.mb, a.chunk))["store"])
        return self.clock

    def _finish_message(self, a, k):
        if a.kind == "F" and k < self.p * self.v - 1:
            out = self.saved[(a.mb, a.chunk)]["out"]
            self._send(out, (k + 1) % self.p, self._tag("F", a.mb, k), self.clock)
        elif a.kind == "B" and k > 0:
            self._send(self._last_input.grad, (k - 1) % self.p, self._tag("B", a.mb, k), self.clock)


def microbatches(cfg, m, batch_size):
    """The same m micro-batches on every rank (only the first and last piece read them)."""
    return [tiny.synthetic_batch(cfg, batch_size, seed=mb) for mb in range(m)]


def measure_pieces(pieces, batch, hidden):
    """Activation bytes of one micro-batch through each piece and through one layer, held from F to
    B and from a split B to W (`split_backward.measure`). Untimed, so it is also the warm-up: the
    first backward in a process pays for starting autograd's engine, which would otherwise show up
    as a bubble."""
    x, y = batch
    def inputs():  # a received activation is a leaf that needs its gradient
        return torch.randn(*x.shape, hidden, requires_grad=True)
    costs = [split_backward.measure(piece, (x if piece.first else inputs(), y),
                                    None if piece.last else torch.randn(*x.shape, hidden), count_flops=False)
             for piece in pieces]
    layer = split_backward.measure(pieces[0].blocks[0], (inputs(),), torch.randn(*x.shape, hidden),
                                   count_flops=False)
    for piece in pieces:
        piece.zero_grad(set_to_none=True)
    return costs, layer


def reference_grads(cfg, data):
    """One process, the whole batch (all micro-batches concatenated), one backward."""
    net = tiny.build(cfg, seed=0)
    net(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])).backward()
    return {n: p.grad for n, p in net.named_parameters()}


@launch.on_cpu('the executor pads every action to a wall-clock time per work unit and sends its logical '
               'clock inside each message: a CPU emulation')
def run(rank, world_size, schedule="1f1b", m=4, v=1, unit_seconds=0.05, batch_size=2, lock=None):
    """Execute one schedule; compare gradients with one process; measure both bubbles."""
    p, cfg = world_size, config()
    actions = schedules.build(schedule, p, m, v)[rank]
    net = tiny.build(cfg, seed=0)
    pieces = split(net, p * v)
    mine = [pieces[c * p + rank] for c in range(v)]
    data = microbatches(cfg, m, batch_size)
    costs, layer = measure_pieces(mine, data[0], cfg.hidden)
    ex = Executor(mine, rank, p, v, schedules.costs(schedule, v), unit_seconds, data, m, cfg.hidden,
                  split_bw=schedule in schedules.SPLIT, lock=lock)
    torch.distributed.barrier()
    ex.run(actions)
    if (m, batch_size) not in _REFERENCE:  # one process's gradients depend on m alone: once per m
        _REFERENCE[m, batch_size] = reference_grads(cfg, data)
    ref = _REFERENCE[m, batch_size]
    errors = [(q.grad - ref[n]).abs().max().item() for piece in mine for n, q in piece.named]
    return {"events": ex.events, "clock": ex.clock, "busy": sum(ex.cost[a.kind] for a in actions),
            "max_abs_error_grad": max(errors), "peak_inflight": ex.peak, "message_bytes": ex.message_bytes,
            "actions": [repr(a) for a in actions], "activation_bytes_peak": ex.peak_bytes,
            "piece_costs": costs, "layer": layer}


def summarize(results, schedule, m, v):
    """Bubble fractions from all ranks' timelines (logical, in work units, and wall-clock), and memory.

    activation_bytes_peak: per stage, the most bytes of activations held for backward after any
    action (measured; see `Executor`). peak_inflight: per stage, the most micro-batch chunks held.
    layer: one transformer layer, one micro-batch: activation_bytes_F (held from F to B) and
    activation_bytes_W (held from a split B to W). activation_layers_peak: the peak in layers'
    worth, activation_bytes_peak / layer activation_bytes_F. piece_costs: the same two byte
    counts per stage and chunk. FLOPs are counted in one process: `split_backward.costs`.
    """
    p = len(results)
    total = max(r["clock"] for r in results)
    busy = results[0]["busy"]
    formula = schedules.formula(schedule, p, m, v)
    layer = results[0]["layer"]
    return {"world_size": p, "schedule": schedule, "microbatches": m, "chunks": v,
            "max_abs_error_grad": max(r["max_abs_error_grad"] for r in results),
            "bubble_fraction": (total - busy) / total, "bubble_fraction_formula": formula["over_total"],
            "bubble_over_ideal": (total - busy) / busy, "bubble_over_ideal_formula": formula["over_ideal"],
            "bubble_fraction_wallclock": wall_bubble([r["events"] for r in results]),
            "peak_inflight": [r["peak_inflight"] for r in results],
            "message_bytes": results[0]["message_bytes"],
            "activation_bytes_peak": [r["activation_bytes_peak"] for r in results],
            "activation_layers_peak": [r["activation_bytes_peak"] / layer["activation_bytes_F"]
                                       for r in results],
            "layer": layer, "piece_costs": [r["piece_costs"] for r in results]}


def wall_bubble(events):
    """1 - busy / total over all ranks' wall-clock events. Busy is each action's nominal work
    (``wall_work``, cost times seconds per unit), never wall_end - wall_start: compute past the
    padding or a late sleep only lengthens the wall, so load can raise this bubble, not lower it."""
    t0 = min(e["wall_start"] for evs in events for e in evs)
    t1 = max(e["wall_end"] for evs in events for e in evs)
    return 1 - max(sum(e["wall_work"] for e in evs) for evs in events) / (t1 - t0)


@launch.on_cpu('the executor pads every action to a wall-clock time per work unit and sends its logical '
               'clock inside each message: a CPU emulation')
def sweep(rank, world_size, configs, unit_seconds=0.0):
    """`run` for several (schedule, m, v) in one job; returns the summaries on every rank, each with
    ``events``: per stage, one dict per action (action, start, end in work units, wall_start,
    wall_end, activation_bytes held after it). A config's optional fourth item is a lock
    (`wall_clock.OneDevice`) that serialises the stages' work: the planted bug."""
    out = []
    for name, m, v, *lock in configs:
        mine = run(rank, world_size, name, m, v, unit_seconds, lock=lock[0] if lock else None)
        everyone = [None] * world_size
        torch.distributed.all_gather_object(everyone, mine)
        out.append(summarize(everyone, name, m, v) | {"events": everyone and [r["events"] for r in everyone]})
    return out


def main(argv=None):
    from labs.launcher import cli
    parser = cli.parser("Pipeline parallelism: run a schedule, check the gradients, measure the bubble.")
    parser.add_argument("--schedule", choices=schedules.SCHEDULES, default="1f1b")
    parser.add_argument("--microbatches", type=cli.positive_int, default=8)
    parser.add_argument("--chunks", type=cli.positive_int, default=1,
                        help="model chunks per rank (interleaved)")
    parser.add_argument("--unit-ms", type=cli.positive_float, default=50.0,
                        help="wall-clock milliseconds per work unit")
    args = cli.parse(parser, argv)
    schedules.build(args.schedule, args.world_size, args.microbatches, args.chunks)  # refuse bad input here
    # every stage runs m forwards (1 unit) and backwards (2)
    least = 3 * args.microbatches * args.unit_ms / 1e3
    if least > args.timeout:
        raise ValueError(f"{args.microbatches} micro-batches at --unit-ms {args.unit_ms:g} take at least "
                         f"{least:,.0f} s, above --timeout {args.timeout:g}; lower --microbatches or "
                         "--unit-ms, or raise --timeout.")
    if config().n_layer % (args.world_size * args.chunks):
        split(tiny.build(config()), args.world_size * args.chunks)
    results = launch.launch(run, args.world_size, args.schedule, args.microbatches, args.chunks,
                            args.unit_ms / 1e3, timeout=args.timeout)
    if results is None:
        return
    r = summarize(results, args.schedule, args.microbatches, args.chunks)
    cli.report(r, args,
               f"{args.schedule} p={r['world_size']} m={args.microbatches} v={args.chunks}: max grad error "
               f"{r['max_abs_error_grad']:.1e}; bubble {r['bubble_fraction']:.3f} in work units, "
               f"{r['bubble_fraction_wallclock']:.3f} wall-clock, formula "
               f"{r['bubble_fraction_formula']:.3f}; peak in flight per stage {r['peak_inflight']}, "
               f"peak activation bytes per stage {r['activation_bytes_peak']}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
