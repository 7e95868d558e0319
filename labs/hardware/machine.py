"""Chapter 11: the machine at hand, measured; and a real two-node launch on one machine.

Measured here, with the device name: host memory copy bandwidth, a quick gloo loopback ping-pong
between two processes (an 8-byte message's fastest and median of 7 back-to-back trips, one way: a
quick look, not the book's latency, which `labs.hardware.latency` takes over many more tries; and
bandwidth from a large message); on a GPU box also device-to-device and pinned host-to-device
copies. A two-launcher torchrun run (``--nnodes 2``, c10d rendezvous on 127.0.0.1) runs an existing
lab unchanged across two "nodes" (torch.distributed elastic docs, "torchrun"); `two_node_commands`
prints what a reader types on two real machines.

    python -m labs.hardware.machine --json
"""
import os
import platform
import socket
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

from labs.launcher import launch, torchrun

# this file is labs/<package>/<file>.py: three levels up is the repository
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_copy(nbytes=1 << 26, repeats=5):
    """Host memcpy: bytes per second of ``dst.copy_(src)`` (read + write counted once, as memcpy)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # first touch pages outside the timing
    return {"bytes": nbytes, "seconds": (s := _median_seconds(lambda: dst.copy_(src), repeats)),
            "bytes_per_s": nbytes / s}


def gpu_copies(nbytes=1 << 28, repeats=5):
    """Device-to-device and pinned host-to-device copy bandwidth, or None with the reason."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine: GPU copies not measured"}
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b, host = torch.empty_like(a), torch.empty(nbytes, dtype=torch.uint8).pin_memory()

    def timed(dst, src):
        dst.copy_(src)
        torch.cuda.synchronize()
        return nbytes / _median_seconds(lambda: (dst.copy_(src), torch.cuda.synchronize()), repeats)
    return {"device": torch.cuda.get_device_name(), "bytes": nbytes,
            "d2d_bytes_per_s": timed(b, a), "h2d_bytes_per_s": timed(a, host)}


@launch.on_cpu("gloo's loopback between two processes of this machine")
def ping_pong(rank, world_size, sizes=(8, 1 << 24), repeats=7):
    """Rank 0 and 1 bounce a message back to back; one-way time = round trip / 2 (gloo loopback via
    TCP), the median and the fastest of ``repeats`` trips (`labs.hardware.latency` says why they differ)."""
    out = {}
    for nbytes in sizes:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        peer = 1 - rank

        def trip():
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
        trip()
        dist.barrier()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            trip()
            times.append((time.perf_counter() - start) / 2)
        out[nbytes] = {"median": statistics.median(times), "fastest": min(times)}
    return out


def measure():
    """All figures of this machine, with its name: the result `--json` prints."""
    oneway = launch.spawn(ping_pong, 2, backend="gloo")[0]
    small, large = min(oneway), max(oneway)
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch": torch.__version__,
            "host_copy": host_copy(),
            # 7 back-to-back trips: a quick look; the book's latency is `labs.hardware.latency`'s
            "gloo_loopback": {"pingpong_fastest_s": oneway[small]["fastest"],
                              "pingpong_median_s": oneway[small]["median"], "small_bytes": small,
                              "bandwidth_bytes": large, "bytes_per_s": large / oneway[large]["median"]},
            "gpu": gpu_copies()}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_node_commands(module_args, nproc_per_node=2, host="127.0.0.1", port=29500):
    """The torchrun command of each of two nodes, as a reader types it (run the first on the node
    at ``host``); `two_node_run` runs the same arguments as ``python -m torch.distributed.run``. No
    ``--node-rank``: torch 2.13's torchrun uses it only with the static rendezvous and warns that it
    ignores it under c10d (torch/distributed/run.py)."""
    return [["torchrun", "--nnodes=2", f"--nproc-per-node={nproc_per_node}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", "--rdzv-id=labs-two-node",
             "-m", *module_args] for i in range(2)]


def launcher_gpus(launchers, nproc_per_node, visible=None):
    """CUDA_VISIBLE_DEVICES for each of ``launchers`` torchrun launchers on this machine: each its
    own ``nproc_per_node`` GPUs where there are enough for all of them, so two "nodes" never put two
    ranks on one GPU (NCCL refuses that); else none, and their ranks run on gloo. ``visible``: the
    GPUs this process may use (its CUDA_VISIBLE_DEVICES, or every GPU torch sees)."""
    if visible is None:
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        visible = ([d for d in listed.split(",") if d.strip()] if listed is not None
                   else [str(i) for i in range(count)])
    if len(visible) < launchers * nproc_per_node:
        return [""] * launchers
    return [",".join(visible[i * nproc_per_node:(i + 1) * nproc_per_node]) for i in range(launchers)]


def _json_line(text):
    import json
    lines = [line for line in text.splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines]


def two_node_run(module_args, nproc_per_node=2, timeout=180, single=True):
    """Run ``python -m <module_args>`` under two torchrun launchers (two "nodes") and, unless
    ``single=False``, under one.

    Returns both JSON results, which rank reported and the commands used. With c10d rendezvous
    torchrun assigns node ranks by sorting the nodes' descriptors, (address, process id, local id)
    (torch 2.13, torch/distributed/elastic/rendezvous/dynamic_rendezvous.py,
    ``_mark_rendezvous_complete``), so global rank 0 may live under either launcher: exactly one of
    the two prints the JSON line.
    """
    cmds = two_node_commands(module_args, nproc_per_node, port=free_port())
    env = torchrun.child_env(REPO)
    gpus = launcher_gpus(2, nproc_per_node)
    procs = [subprocess.Popen(torchrun.command(*c[1:]), cwd=REPO, env=dict(env, CUDA_VISIBLE_DEVICES=g),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c, g in zip(cmds, gpus)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"a two-node launcher failed (exit {p.returncode}):\n{err[-2000:]}")
    reports = [_json_line(o) for o, _ in outs]
    one = subprocess.run(torchrun.command(f"--nproc-per-node={2 * nproc_per_node}", "-m", *module_args),
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                         check=True).stdout if single else None
    return {"two_node": [r for rep in reports for r in rep],
            "reports_per_launcher": [len(r) for r in reports], "single": _json_line(one) if single else None,
            "commands": [" ".join(c) for c in cmds]}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Measure this machine: host copy, gloo loopback, GPU copies if a GPU exists.",
                   world_size_default=2)
    args = cli.parse(p, argv)
    if args.world_size != 2:
        raise ValueError(f"the loopback ping-pong uses exactly 2 ranks, got --world-size {args.world_size}; "
                         "drop --world-size.")
    r = measure()
    cli.report(r, args, f"{r['host']} ({r['cores']} cores): host copy "
               f"{r['host_copy']['bytes_per_s'] / 1e9:.1f} GB/s, gloo loopback 8-byte ping-pong, one way: "
               f"fastest of 7 back-to-back trips {r['gloo_loopback']['pingpong_fastest_s'] * 1e6:.0f} us, "
               f"median {r['gloo_loopback']['pingpong_median_s'] * 1e6:.0f} us; bandwidth "
               f"{r['gloo_loopback']['bytes_per_s'] / 1e9:.2f} GB/s; GPU: {r['gpu']}")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
