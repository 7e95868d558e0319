"""Chapter 13: a straggler caused by a slow link, not by slow compute, and a probe that finds the link.

The gradient is averaged by a hand ring all-reduce (reduce-scatter then all-gather, 2(N-1) rounds,
each rank sending one chunk to its successor per round, as in chapter 2), and one directed
link, ``slow_link = (src, dst)``, delays every message it carries, as a flapping port or a
degraded cable would. Every rank's compute time stays the same, so `stragglers.find_straggler`
names no rank; only the step time grows, alike on every rank. The probe then times a round trip
over each ring link in turn, one pair of ranks at a time, and names the link whose round trip
stays well above the others' (`find_slow_link`).
"""
import statistics
import time

import torch
import torch.distributed as dist

from labs.failures import fault_training as ft
from labs.failures.stragglers import find_straggler
from labs.launcher import launch


def send(t, dst, rank, slow_link, delay_s):
    """Send ``t`` to ``dst``; a message on the slow link is held back ``delay_s`` first."""
    if (rank, dst) == slow_link:
        time.sleep(delay_s)
    return dist.isend(t, dst)


def ring_allreduce(flat, rank, world, slow_link, delay_s):
    """Sum of ``flat`` over ranks by the ring, in place on a copy; returns the sum."""
    chunks = list(torch.tensor_split(flat.clone(), world))    # world chunks of (P / world,)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for phase in ("reduce-scatter", "all-gather"):
        for k in range(world - 1):
            # reduce-scatter: send chunk rank - k, receive chunk rank - k - 1 and add it in;
            # all-gather: send the finished chunk rank + 1 - k, receive chunk rank - k and keep it
            out, inn = ((rank - k) % world, (rank - k - 1) % world) if phase == "reduce-scatter" else \
                ((rank + 1 - k) % world, (rank - k) % world)
            buf = torch.empty_like(chunks[inn])
            work = send(chunks[out], nxt, rank, slow_link, delay_s)
            dist.recv(buf, prv)
            work.wait()
            chunks[inn] = chunks[inn] + buf if phase == "reduce-scatter" else buf
    return torch.cat(chunks)


def probe_links(rank, world, slow_link, delay_s, repeats=10, numel=1024):
    """Fastest of ``repeats`` round trips (s) over each ring link r -> r+1 and back, timed by rank r,
    one link at a time so no other traffic shares the measurement; (world,) on every rank. The
    minimum, not the median: a rank the OS did not schedule in time only adds to a round trip,
    while a slow link delays every one of them."""
    rtt = torch.zeros(world, dtype=torch.float64)
    msg = torch.zeros(numel)
    for link in range(world):
        src, dst = link, (link + 1) % world
        dist.barrier()   # both ends start together: a late receiver would add to the first round trip
        times = []
        for _ in range(repeats):
            if rank == src:
                t0 = time.perf_counter()
                send(msg, dst, rank, slow_link, delay_s).wait()
                dist.recv(msg, dst)
                times.append(time.perf_counter() - t0)
            elif rank == dst:
                dist.recv(msg, src)
                send(msg, src, rank, slow_link, delay_s).wait()
        if rank == src:
            rtt[link] = min(times)
    dist.all_reduce(rtt)   # each entry was set by one rank only
    return rtt.tolist()


def run(rank, world, steps, slow_link, delay_s):
    """``steps`` DDP steps with the ring all-reduce, then the link probe; per-rank compute times
    all-gathered, this rank's step times, the final loss."""
    model, opt = ft.make_model()
    compute, total = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        loss, g = ft.local_grad(model, *ft.batch(step, rank, world))
        t1 = time.perf_counter()
        ft.apply(model, opt, ring_allreduce(g, rank, world, slow_link, delay_s) / world)
        compute.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    times = torch.tensor(compute, dtype=torch.float64)      # (steps,)
    everyone = [torch.empty_like(times) for _ in range(world)]
    dist.all_gather(everyone, times)
    return {"compute": torch.stack(everyone).tolist(), "step": total, "loss": ft.mean_loss(loss, world),
            "rtt": probe_links(rank, world, slow_link, delay_s)}


@launch.on_cpu("the slow link is a sleep in a hand ring's sends, timed by the host clock")
def both(rank, world, steps, slow_link, delay_s):
    """A healthy run then the slow-link run, in the same processes."""
    return run(rank, world, steps, None, 0.0), run(rank, world, steps, slow_link, delay_s)


def find_slow_link(rtt, ratio=3.0, gap_s=0.02):
    """The link index whose round trip is above ``ratio`` times the median of the others' and
    ``gap_s`` longer, or None."""
    for link, t in enumerate(rtt):
        others = statistics.median(rtt[:link] + rtt[link + 1:])
        if t > ratio * others and t - others > gap_s:
            return link
    return None


def slow_link_scenario(world_size=4, slow_link=(1, 2), delay_s=0.05, steps=6, timeout=60.0):
    """The scenario: who the compute-time detector names (no one), which link the probe names, the
    healthy run's probe (no link), equal losses (slow, not wrong), and the slowdown (a timing)."""
    if not (0 <= slow_link[0] < world_size and slow_link[1] == (slow_link[0] + 1) % world_size):
        raise ValueError(f"slow_link {slow_link} is not a ring link r -> r+1 of {world_size} ranks.")
    healthy, slow = zip(*launch.spawn(both, world_size, steps, slow_link, delay_s, timeout=timeout))
    step_time = [statistics.median(max(r["step"][s] for r in res) for s in range(steps)) for res in (healthy,
                                                                                                     slow)]
    link = find_slow_link(slow[0]["rtt"])
    return {"scenario": "slow-link", "world_size": world_size, "injected_link": list(slow_link),
            "compute_names": find_straggler(slow[0]["compute"])[0],
            "detected_link": None if link is None else [link, (link + 1) % world_size],
            "false_alarm_healthy": find_slow_link(healthy[0]["rtt"]),
            "final_loss_match": slow[0]["loss"] == healthy[0]["loss"],
            "rtt_s": slow[0]["rtt"], "healthy_step_s": step_time[0], "slow_step_s": step_time[1],
            "slowdown": step_time[1] / step_time[0],
            # formula: the slow link carries one message in each of the ring's 2(N-1) rounds
            "held_per_step_s": 2 * (world_size - 1) * delay_s}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Slow one ring link of a small DDP job and find it with a link probe.", 4)
    p.add_argument("--link", type=int, default=1, help="the slow link is LINK -> LINK+1 (default 1)")
    args = cli.parse(p, argv)
    if args.world_size < 3:
        raise ValueError(f"--world-size {args.world_size} leaves no other links to compare with; "
                         "use 3 or more.")
    link = (args.link, (args.link + 1) % args.world_size)
    result = slow_link_scenario(world_size=args.world_size, slow_link=link, timeout=args.timeout)
    cli.report(result, args, f"slow link {link[0]} -> {link[1]}: compute times name rank "
               f"{result['compute_names']}; the probe names link {result['detected_link']}; "
               f"final loss match {result['final_loss_match']}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
