"""Worker functions for the tests: spawned ranks import them by name, so they live in a module."""
import os
import time

import torch
import torch.distributed as dist

from labs import comm


def report_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world_size, "pid": os.getpid(), "sum": t.item()}


def print_then_return(rank, world_size):
    print(f"hello from rank {rank}")
    return rank


def raise_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()  # the healthy ranks wait for the failed one, as they would in a real job
    return rank


def exit_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        os._exit(3)
    dist.barrier()
    return rank


def hang_on(rank, world_size, bad_rank, pid_dir):
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == bad_rank:
        time.sleep(3600)  # stuck in user code
    dist.barrier()        # stuck waiting for the rank above
    return rank


def count_collectives(rank, world_size, numel):
    """Run each counted collective once; return the results and the tally."""
    x = torch.arange(numel, dtype=torch.float32) + rank
    out = {}
    with comm.counting() as tally:
        reduced = x.clone()
        comm.all_reduce(reduced)
        out["all_reduce"] = reduced
        shard = torch.full((4,), float(rank))
        gathered = torch.empty(4 * world_size)
        comm.all_gather(gathered, shard)
        out["all_gather"] = gathered
        full = torch.arange(4 * world_size, dtype=torch.float32)
        mine = torch.empty(4)
        comm.reduce_scatter(mine, full)
        out["reduce_scatter"] = mine
        b = torch.full((5,), float(rank))
        comm.broadcast(b, src=0)
        out["broadcast"] = b
        if world_size > 1:  # a ring of point-to-point messages
            send_buf, recv_buf = torch.full((3,), float(rank)), torch.empty(3)
            reqs = [comm.isend(send_buf, (rank + 1) % world_size), comm.irecv(recv_buf, (rank - 1) % world_size)]
            for r in reqs:
                r.wait()
            out["ring_p2p"] = recv_buf
    return {"out": out, "tally": tally.as_dict()}


def tp_group_sum(rank, world_size, tp):
    from labs import groups
    g = groups.Groups(groups.layout(world_size, tp=tp))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=g.tp)
    return {"coords": g.coords, "tp_ranks": g.tp_ranks, "dp_ranks": g.dp_ranks, "tp_sum": t.item()}
