"""The smallest lab: start N ranks, all-reduce their ranks, and time the whole call.

    python -m labs.launcher.hello --world-size 4          # what starting 4 ranks costs here
    python -m labs.launcher.hello --world-size 3 --fault hang --fault-rank 1 --timeout 10
    torchrun --nproc_per_node=2 -m labs.launcher.hello --json

``--fault`` makes one rank raise, exit, be killed or hang on purpose, so the launcher's promises
(`labs.launcher.launch`: the failing or hung rank named, no orphan left) can be watched.
"""
import os
import signal
import time

import torch
import torch.distributed as dist

from labs.launcher import cli, launch

FAULTS = ("raise", "exit", "kill", "hang")


def hello(rank, world_size, fault=None, fault_rank=None):
    """The smallest lab: every rank contributes its rank to an all-reduce.

    ``fault`` makes rank ``fault_rank`` raise, exit, be killed (SIGKILL) or hang in its own code
    between two collectives, while its peers wait for it in the second: the launcher's promises,
    tried on purpose (`python -m labs.launcher.hello --fault hang --fault-rank 1`).
    """
    t = torch.tensor([float(rank)], device=launch.device())
    dist.all_reduce(t)
    if rank == fault_rank:
        if fault == "raise":
            raise RuntimeError(f"injected failure on rank {rank}")
        if fault == "exit":
            os._exit(3)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hang":
            while True:  # busy in its own code, as a rank in an endless data-loading loop would be
                time.sleep(0.1)
    dist.barrier()
    return {"rank": rank, "pid": os.getpid(), "sum_of_ranks": t.item(), "backend": dist.get_backend()}


def main(argv=None):
    """`python -m labs.launcher.hello --world-size N`: measure what starting N ranks costs here."""
    from labs.launcher import cli
    parser = cli.parser("Start N ranks, all-reduce their ranks, and time the whole call.")
    parser.add_argument("--fault", choices=FAULTS, help="make --fault-rank raise, exit, be killed or hang")
    parser.add_argument("--fault-rank", type=int, default=1, help="the rank --fault applies to (default 1)")
    args = cli.parse(parser, argv)
    if args.fault and not 0 <= args.fault_rank < args.world_size:
        raise ValueError(f"--fault-rank {args.fault_rank} is not a rank of {args.world_size}; "
                         f"pick one from 0 to {args.world_size - 1}.")
    start = time.perf_counter()
    results = launch.launch(hello, args.world_size, args.fault, args.fault_rank if args.fault else None,
                     timeout=args.timeout)
    if results is None:
        return
    seconds = time.perf_counter() - start
    n = len(results)
    result = {"world_size": n, "backend": results[0]["backend"], "seconds": seconds,
              "sum_of_ranks": results[0]["sum_of_ranks"], "expected_sum": n * (n - 1) / 2}
    cli.report(result, args, f"{n} ranks on {result['backend']}: all-reduce of ranks = "
                             f"{result['sum_of_ranks']:g} (expected {result['expected_sum']:g}); "
                             f"spawn + init + run took {seconds:.2f} s")


if __name__ == "__main__":
    # Run the copy of this module that `import labs.launcher.hello` gives, so the function the ranks
    # import is the same one (this file's own functions live in a module named __main__).
    from labs.launcher import hello as imported
    cli.main(imported.main)
