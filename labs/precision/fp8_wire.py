"""FP8 through gloo: the bits travel as uint8, and the library's wire bytes are read (chapter 8).

gloo has no FP8 type, so an all-gather of an FP8 tensor is refused. Viewed as ``uint8`` the same
bytes go through; the receiver views them as FP8 again and divides by the sender's fp32 scale,
which travels in a second all-gather. What each all-gather costs is read from the wire
(`labs.measure.wire`: the bytes this process handed to its sockets, gloo's 48-byte preambles
included) for a BF16 shard and for the same shard as FP8, and set beside gloo's model of its ring
all-gather (`wire.gloo_all_gather`, from gloo's source) for the payloads actually gathered.

    python -m labs.precision.fp8_wire --experiment fp8-allgather --world-size 2 --json
"""
import torch
import torch.distributed as dist

from labs.launcher import launch
from labs.measure import comm, wire
from labs.precision import fp8


def _gloo_refuses_fp8(shard):
    """The first line of what the process group says to an FP8 all-gather, or None if it takes it."""
    out = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype)
    try:
        comm.all_gather_single(out, shard)
        return None
    except (RuntimeError, TypeError, ValueError) as exc:
        return str(exc).splitlines()[0][:120]


def _shard(rank, numel):
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)  # (numel,)


@launch.on_cpu("it reads gloo's wire and gloo's refusal of FP8")
def allgather_worker(rank, world_size, numel=4096):
    """All-gather a BF16 shard, then the same shard as E4M3 bytes plus its fp32 scale, each inside
    ``comm.counting(wire=True)``: payloads from the tensors handed over, wire bytes measured."""
    shard = _shard(rank, numel)
    with comm.counting(wire=True) as bf16_tally:
        full = torch.empty(world_size * numel, dtype=torch.bfloat16)
        comm.all_gather(full, shard)
    q, scale = fp8.quantize(shard.float().reshape(1, -1), "tensor")  # (1, numel) e4m3, (1, 1) fp32
    with comm.counting(wire=True) as data_tally:
        raw = torch.empty(world_size * numel, dtype=torch.uint8)
        comm.all_gather(raw, q.reshape(-1).view(torch.uint8))  # the FP8 bits, as bytes
    with comm.counting(wire=True) as scale_tally:
        scales = torch.empty(world_size, dtype=torch.float32)
        comm.all_gather(scales, scale.reshape(1).float())
    # last: gloo's refusal can surface at the next collective's wait instead of its own, so no
    # measured collective may follow it
    refused = _gloo_refuses_fp8(q.reshape(-1)) if dist.get_backend() == "gloo" else None
    gathered = raw.view(torch.float8_e4m3fn).float().reshape(world_size, numel) / scales.reshape(-1, 1)
    tallies = {"bf16": bf16_tally, "fp8": data_tally, "scale": scale_tally}
    return {"payload": {k: t.payload_bytes for k, t in tallies.items()},
            "wire": {k: t.wire_bytes_sent if not t.wire_missing else None for k, t in tallies.items()},
            "wire_missing": sorted({m for t in tallies.values() for m in t.wire_missing}),
            "gloo_refuses_fp8": refused, "gathered": gathered, "full_bf16": full}


def allgather_bytes(world_size=2, numel=4096, timeout=60.0):
    """Spawn ``world_size`` ranks of `allgather_worker`; check the gathered FP8 and BF16 on rank 0
    against every rank's shard made here. Returns, per rank, payload and wire bytes of the three
    all-gathers, and gloo's model for the payloads gathered (``model``)."""
    results = launch.spawn(allgather_worker, world_size, numel, timeout=timeout)
    r0 = results[0]
    for rank in range(world_size):
        shard = _shard(rank, numel)
        local = fp8.dequantize(*fp8.quantize(shard.float().reshape(1, -1), "tensor")).reshape(-1)
        assert torch.equal(r0["gathered"][rank], local), f"rank {rank}'s FP8 bytes arrived changed"
        assert torch.equal(r0["full_bf16"][rank * numel:(rank + 1) * numel], shard)
    model = {k: wire.gloo_all_gather(world_size * p, world_size) for k, p in r0["payload"].items()}
    return {"world_size": world_size, "numel": numel, "gloo_refuses_fp8": r0["gloo_refuses_fp8"],
            "payload": r0["payload"], "wire": [r["wire"] for r in results], "model": model,
            "wire_missing": r0["wire_missing"]}


def _allgather(args):
    r = allgather_bytes(args.world_size, timeout=args.timeout)
    w = r["wire"][0]
    return r, (f"all-gather per rank, payload: bf16 {r['payload']['bf16']} B, fp8 {r['payload']['fp8']} B "
               f"+ scale {r['payload']['scale']} B; wire bytes on rank 0: bf16 {w['bf16']}, fp8 {w['fp8']}, "
               f"scale {w['scale']} (gloo's model {r['model']}); gloo on raw fp8: {r['gloo_refuses_fp8']}")


EXPERIMENTS = {"fp8-allgather": _allgather}

if __name__ == "__main__":
    from labs.launcher import cli
    from labs.precision import experiment
    cli.main(lambda: experiment.main(experiments=EXPERIMENTS))
