"""Worker functions for the tests: spawned ranks import them by name, so they live in a module."""
import os
import time

import torch
import torch.distributed as dist

from labs.measure import comm, wire
from labs.data_parallel import hand_ring
from labs.launcher import launch


def report_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world_size, "pid": os.getpid(), "sum": t.item()}


def print_then_return(rank, world_size):
    print(f"hello from rank {rank}")
    return rank


def print_lines(rank, world_size, n):
    for i in range(n):
        print(f"line {i}")
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
            reqs = [comm.isend(send_buf, (rank + 1) % world_size),
                    comm.irecv(recv_buf, (rank - 1) % world_size)]
            for r in reqs:
                r.wait()
            out["ring_p2p"] = recv_buf
    return {"out": out, "tally": tally.as_dict(), "wire_checks": wire_checks(rank, world_size)}


def tp_group_sum(rank, world_size, tp):
    from labs import groups
    from labs.dims import ParallelDims
    g = groups.Groups(ParallelDims.build(world_size, tp=tp))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=g.tp)
    return {"coords": g.coords, "tp_ranks": g.tp_ranks, "dp_ranks": g.dp_ranks, "tp_sum": t.item()}


def mesh_groups(rank, world_size, dims):
    """{dimension: this rank's group's ranks} of ``device_mesh(dims)``, the flattened "dp" included."""
    from labs.groups import device_mesh
    mesh = device_mesh(dims, "cpu")
    return {a: dist.get_process_group_ranks(mesh.get_group(a)) for a in mesh.mesh_dim_names + ("dp",)
            if a == "dp" or a in mesh.mesh_dim_names}


# ---- hand collectives (labs.data_parallel.hand_ring.hand_collectives) ------------------------

def _integer_valued(numel, rank, dtype, salt=0):
    """Small integers, exact in bf16 whatever the order of the sum: equality can be exact."""
    return ((torch.arange(numel) * (rank + 3) + salt) % 11).to(dtype)


def _hand_vs_library(rank, n, group, dtype, k):
    """Each collective by hand and by the library on ``group``; equality and counted bytes per op."""
    es = torch.empty(0, dtype=dtype).element_size()
    full = _integer_valued(n * k, rank, dtype)
    lib = {"all_reduce": full.clone(), "reduce_scatter": torch.empty(k, dtype=dtype),
           "all_gather": torch.empty(n * k, dtype=dtype)}
    dist.all_reduce(lib["all_reduce"], group=group)
    comm.reduce_scatter_single(lib["reduce_scatter"], full, group=group)
    comm.all_gather_single(lib["all_gather"], full[:k].contiguous(), group=group)
    hand = {"all_reduce": full.clone(), "reduce_scatter": torch.empty(k, dtype=dtype),
            "all_gather": torch.empty(n * k, dtype=dtype)}
    with comm.counting() as tally, hand_ring.hand_collectives():
        work = comm.all_reduce(hand["all_reduce"], group=group, async_op=True)
        work.wait()
        comm.reduce_scatter(hand["reduce_scatter"], full, group=group)
        comm.all_gather(hand["all_gather"], full[:k].contiguous(), group=group)
    return {"equal": {op: torch.equal(hand[op], lib[op]) for op in lib}, "async_done": work.is_completed(),
            "sent": {op: tally.ops[op]["bytes_sent"] for op in lib},
            "received": {op: tally.ops[op]["bytes_received"] for op in lib},
            "formula": tally.formula_bytes_sent,
            "payload": {op: tally.ops[op]["payload_bytes"] for op in lib}, "element_size": es}


def _uneven(rank, n, group, numel):
    """Uneven chunks (numel not a multiple of n): the ring halves against the library all-reduce."""
    from labs.data_parallel import hand_ring
    x = _integer_valued(numel, rank, torch.float32, salt=5)
    exact = x.clone()
    dist.all_reduce(exact, group=group)
    sizes = comm.ring_chunks(numel, n)
    r = dist.get_rank(group)
    with comm.counting() as tally:
        mine = torch.empty(sizes[r])
        hand_ring.ring_reduce_scatter(mine, list(x.split(sizes)), group=group)
        chunks = list(torch.zeros(numel).split(sizes))
        chunks[r].copy_(mine)
        hand_ring.ring_all_gather_(chunks, group=group)
        m = x.clone()
        hand_ring.ring_allreduce(m, group=group, op=dist.ReduceOp.MAX)
    lib_max = x.clone()
    dist.all_reduce(lib_max, op=dist.ReduceOp.MAX, group=group)
    return {"rs_equal": torch.equal(mine, exact.split(sizes)[r]),
            "ag_equal": torch.equal(torch.cat(chunks), exact), "max_equal": torch.equal(m, lib_max),
            "sizes": sizes, "sent": tally.bytes_sent}


def hand_collectives(rank, world_size, k=10, numel=13):
    """Hand rings vs library on the whole world, and on the subgroup [0, 2, 3] when there are 4 ranks."""
    out = {"world": {str(dt): _hand_vs_library(rank, world_size, None, dt, k)
                     for dt in (torch.float32, torch.bfloat16)},
           "uneven": _uneven(rank, world_size, None, numel)}
    sub_ranks = [0, 2, 3] if world_size == 4 else None
    sub = dist.new_group(sub_ranks) if sub_ranks else None  # every rank must call new_group
    if sub_ranks and rank in sub_ranks:
        out["subgroup"] = _hand_vs_library(rank, 3, sub, torch.bfloat16, k)
        out["subgroup_uneven"] = _uneven(rank, 3, sub, numel)
    errors = []
    with hand_ring.hand_collectives():
        for bad in (lambda: comm.reduce_scatter(torch.empty(3), torch.empty(3 * world_size + 1)),
                    lambda: comm.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND)):
            try:
                bad()
            except ValueError as e:
                errors.append(str(e))
    out["errors"] = errors
    return out


def wire_checks(rank, world_size):
    """counting(wire=True) per op, an async call it cannot measure, and an unreadable /proc/self/io."""
    x = torch.ones(1000)
    with comm.counting(wire=True) as tally:
        comm.all_reduce(x)
        comm.all_reduce(x, async_op=True).wait()
    with comm.wire_bytes() as measured:
        comm.all_reduce(x)
    real, wire.wchar = wire.wchar, lambda: (_ for _ in ()).throw(OSError("no such file"))
    try:
        with comm.wire_bytes() as missing:
            pass
    finally:
        wire.wchar = real
    return {"tally": tally.as_dict(), "wire": measured.bytes, "missing": missing.as_dict()}


# ---- HandDDP semantics beside torch DDP ---------------------------------------------------------

def ddp_semantics(rank, world_size, head_dtype=torch.bfloat16):
    """labs.data_parallel.ddp.semantics, plus the error a bucket cap below one byte raises."""
    from labs.data_parallel import ddp, hand_ddp
    try:
        hand_ddp.HandDDP(ddp.MixedNet(), bucket_cap_bytes=0)
        error = None
    except ValueError as e:
        error = str(e)
    return dict(ddp.semantics(rank, world_size, head_dtype), bad_cap_error=error)


def ring_runs(rank, world_size, numels, naive_numel=101):
    """labs.data_parallel.ring_allreduce.run: ring for several sizes, naive and library for one, in one
    job (one spawn)."""
    from labs.data_parallel import ring_allreduce as ra, ring_steps
    return {"trace": ring_steps.trace(rank, world_size),
            "ring": [ra.run(rank, world_size, numel, "ring", 1) for numel in numels],
            "naive": ra.run(rank, world_size, naive_numel, "naive", 1),
            "library": ra.run(rank, world_size, 1000, "library", 1)}


def ddp_suite(rank, world_size):
    """Every HandDDP check of tests/test_ddp.py for one world size, in one job (spawns are slow)."""
    from labs.data_parallel import ddp
    # seeds_differ: each rank builds its replica from its own seed, so the equality with one process
    # (seed 0) holds only through the broadcast of rank 0's weights at construction (issue 47)
    if world_size == 2:
        return {"run": ddp.run(rank, world_size, 3, seeds_differ=True),
                "semantics": ddp_semantics(rank, world_size),
                "no_sync_off": ddp.run(rank, world_size, 2, 3, use_no_sync=False),
                "overlap": ddp.overlap_on_off(rank, world_size, 2),
                # the named mistake: each all-reduce waited for inside its hook (1 step per mode)
                "overlap_waits": ddp.overlap_on_off(rank, world_size, 1, wait_in_hook=True),
                # the named mistake: every launch held until all buckets are full (1 step per mode)
                "overlap_defers": ddp.overlap_on_off(rank, world_size, 1, defer_launch=True)}
    return {"run": ddp.run(rank, world_size, 3, seeds_differ=True),
            "semantics": ddp_semantics(rank, world_size, torch.float32),
            "no_sync_counted": ddp.run(rank, world_size, 2, 3, counted=True),
            "drift": ddp.drift(rank, world_size, 3, 3)}


def comm_suite(rank, world_size):
    """Every labs.measure.comm check of tests/test_comm.py for one world size, in one job."""
    from labs.data_parallel import ring_allreduce as ra
    out = {"hand": hand_collectives(rank, world_size)}
    if world_size == 3:
        out["library"] = count_collectives(rank, world_size, 10)
    if world_size == 4:
        out["wire_table"] = ra.library_wire_table(rank, world_size, 4_000_000)
    return out


def process_facts(rank, world_size, names=()):
    """Where this rank came from and what it sees: its parent, its environment, its threads."""
    import sys
    return {"pid": os.getpid(), "ppid": os.getppid(), "env": {n: os.environ.get(n) for n in names},
            "argv0": os.path.basename(sys.argv[0]), "cwd": os.getcwd(), "threads": torch.get_num_threads()}


def kill_parent_then_wait(rank, world_size, pid_dir):
    """Rank 0 kills the process that started it (the zygote); everyone then waits in a collective."""
    import signal
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()
    if rank == 0:
        os.kill(os.getppid(), signal.SIGKILL)
    dist.barrier()
    time.sleep(60)


def finish_apart(rank, world_size, folder):
    """Rank 0 returns at once, without a collective; rank 1 returns a second later and says whether
    rank 0's process was still there (waiting for its peers to finish, not gone)."""
    path = os.path.join(folder, "rank0.pid")
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        return None
    while not os.path.exists(path):
        time.sleep(0.01)
    time.sleep(1.0)
    with open(path) as f:
        pid = int(f.read())
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@launch.on_cpu("chapter 12's async window, as labs.checkpointing.async_window._train")
def async_window_commit_without_waiting(rank, world_size, root, steps, tau, omega):
    """Chapter 12's mutant: the hand format's save commits without gathering every rank's checksums
    (each rank 'gathers' only its own), so rank 0 renames the folder while rank 1's save is held."""
    from labs.checkpointing import async_window, sharded_checkpoint as sc

    def own_only(out, obj, group=None):
        out[:] = [obj] * len(out)

    sc.dist.all_gather_object = own_only   # this rank's process only; the training never gathers objects
    return async_window._train(rank, world_size, root, steps, tau, omega)
