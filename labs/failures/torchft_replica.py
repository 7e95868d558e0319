"""One replica group of chapter 13's torchft run (`labs.failures.torchft_run` starts them).

A replica group is one process here (group world size 1): its own TCPStore, its own torchft
``Manager`` (which runs the group's ManagerServer, heartbeats to the lighthouse and asks it for a
quorum every step) and a reconfigurable gloo process group (``torchft.ProcessGroupGloo``),
training the tiny GPT with SGD and momentum. The loop is torchft's (torchft 0.2.0,
torchft/manager.py): ``start_quorum`` before the forward pass, the gradient all-reduce through
``Manager.allreduce`` (a sum over the replicas in the quorum divided by the number that take
part), and the optimizer steps only if ``should_commit`` says every replica's step went through.
That all-reduce is the one torchft's ``DistributedDataParallel`` makes in its communication hook;
the wrapper itself (``--ddp-wrapper``) does not survive a peer's death on gloo in 0.2.0: the
survivor's hook fails ``assert fut._fut`` in backward (torchft/ddp.py), because
``_ManagedWork.wait`` caught the broken all-reduce before the future it returns was set up.

A replica that joins behind the others fetches weights and optimizer state from a live peer
(``HTTPTransport``: a ``torch.save`` stream over HTTP); this module counts that stream's bytes
as they are read. Each replica appends one JSON line per event to ``<folder>/replica<i>.jsonl``
with the wall time: its start, every step (quorum id, participants, committed or not, held-out
loss, a hash of its weights and optimizer state), every recovery (bytes, seconds), its failure.
The run reads only these.

    python -m labs.failures.torchft_replica --replica 1 --lighthouse http://host:port --folder F
    python -m labs.failures.torchft_replica --serve-lighthouse --folder F   # the lighthouse itself
"""
import hashlib
import json
import os
import time
import urllib.request
from datetime import timedelta

import torch

from labs import model as tiny
from labs.failures import bigram

CFG, batch, held_out_loss = bigram.CFG, bigram.batch, bigram.held_out_loss
LR, MOMENTUM = 0.02, 0.9


def optimizer(model):
    """SGD with momentum: its update is linear in the averaged gradient, so a step that averages
    over fewer replicas changes the update visibly (Adam would divide most of it away), and the
    momentum buffers are optimizer state a joining replica must get from a peer."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def digest(model, opt):
    """A hash of the exact bytes of the weights and the optimizer state: equal on two replicas
    only if every bit is."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for state in opt.state.values():
        for v in state.values():
            h.update(v.detach().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()[:16]


class Log:
    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, event, **fields):
        # one write per line: a SIGKILL never leaves half a line
        os.write(self.fd, (json.dumps({"event": event, "time": time.time(), **fields}) + "\n").encode())


def counting_transport(log, timeout):
    """torchft's HTTPTransport, with the recovery's bytes counted where they are read."""
    from torchft.checkpointing import HTTPTransport
    from torchft.checkpointing._serialization import _streaming_load

    class Counted:
        def __init__(self, f):
            self.f, self.n = f, 0

        def read(self, *args):
            data = self.f.read(*args)
            self.n += len(data)
            return data

        def readline(self, *args):
            data = self.f.readline(*args)
            self.n += len(data)
            return data

        def readinto(self, buf):
            n = self.f.readinto(buf)
            self.n += n
            return n

    class CountingHTTPTransport(HTTPTransport):
        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            # what HTTPTransport.recv_checkpoint does without chunks (num_chunks=0), counted
            t0 = time.time()
            with urllib.request.urlopen(f"{metadata}{step}/full", timeout=timeout.total_seconds()) as f:
                counted = Counted(f)
                state = _streaming_load(counted, weights_only=False)
            log("recovered", src_replica_rank=src_rank, step=step, bytes=counted.n, seconds=time.time() - t0,
                started=t0)
            return state

        def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
            log("serving", dst_replica_ranks=list(dst_ranks), step=step)
            super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    return CountingHTTPTransport(timeout=timeout, num_chunks=0)


def train(replica, lighthouse, folder, steps, step_s=0.0, timeout_s=20.0, ready=3, wrapper=False,
          quorum_timeout_s=None):
    """One replica group's life: join, train to ``steps`` committed steps, log every step."""
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    log = Log(os.path.join(folder, f"replica{replica}.jsonl"))
    log("start", pid=os.getpid())
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this group's own store
    model = tiny.build(CFG, seed=0)
    opt = optimizer(model)
    timeout = timedelta(seconds=timeout_s)
    quorum_timeout = timedelta(seconds=quorum_timeout_s or timeout_s)  # how long a quorum may take
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=f"replica_{replica}", lighthouse_addr=lighthouse, store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, timeout=timeout, quorum_timeout=quorum_timeout,
        connect_timeout=timeout, checkpoint_transport=counting_transport(lambda *a, **k: log(*a, **k),
                                                                         timeout),
        init_sync=False)  # every replica builds the same seeded weights
    ddp = DistributedDataParallel(manager, model) if wrapper else model
    _wait_for_peers(folder, replica, ready)
    log("manager_up")
    try:
        _loop(manager, model, opt, ddp, replica, folder, steps, step_s, ready, wrapper, log)
    except BaseException as exc:  # what ended this replica, in its own log, then the traceback
        log("failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        raise
    log("done", step=manager.current_step(), digest=digest(model, opt))
    manager.shutdown(wait=False)


def _loop(manager, model, opt, ddp, replica, folder, steps, step_s, ready, wrapper, log):
    """torchft's training loop: quorum, forward, all-reduce, commit or discard, log."""
    full, since = [], None  # per committed step: did every replica take part? since when not?
    while not finished(manager.current_step(), full, steps, since):
        step, t0 = manager.current_step(), time.time()
        manager.start_quorum()               # asks the lighthouse, while the forward pass runs
        opt.zero_grad()
        x, y = batch(step, replica)
        loss = ddp(x, y)
        manager.wait_quorum()
        t_quorum = time.time()
        _maybe_stop_here(folder, replica, step, model, opt)
        loss.backward()                      # with the wrapper, DDP's hook all-reduces in here
        if not wrapper:
            average(manager, model)
        committed = manager.should_commit()
        if committed:
            opt.step()
            full.append(manager.num_participants() == ready)
        if since is None and not (committed and full[-1]):
            since = time.time()
        # the step this was: a replica that healed has taken the step number of its peers
        log("step", step=manager.current_step() - committed, quorum_id=manager._quorum_id,
            participants=manager.num_participants(), committed=committed, healed=manager._healing,
            loss=loss.item(), held_out=held_out_loss(model), digest=digest(model, opt),
            started=t0, quorum_at=t_quorum)
        time.sleep(step_s)


TAIL = 3         # a run ends with this many steps in which every replica took part
WAIT_S = 300.0   # ... or this long after the first step without every replica


def finished(step, full, steps, since):
    """Train ``steps`` steps, and on until the last TAIL steps had every replica: a replica that
    was killed has rejoined, however long its restart took (``since``: when a step first went
    without every replica), at most WAIT_S seconds later."""
    if since is not None and time.time() - since > WAIT_S:
        return True
    return step >= steps and len(full) >= TAIL and all(full[-TAIL:])


def _maybe_stop_here(folder, replica, step, model, opt):
    """The run's hook for a kill in the middle of a step: if it armed this step (the file names the
    victim), each replica saves its state as it was before the step (for the lab's replay) and
    says it is about to all-reduce, and the victim waits there to be killed."""
    arm = os.path.join(folder, f"arm{step}")
    if not os.path.exists(arm):
        return
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
               os.path.join(folder, f"state{replica}_{step}.pt"))
    open(os.path.join(folder, f"reduce{replica}_{step}"), "w").close()
    with open(arm) as f:
        if int(f.read()) == replica:
            time.sleep(60)  # the peers are in the all-reduce, waiting for us; the run kills us here


def average(manager, model):
    """The gradient all-reduce torchft's DDP hook makes, for the one bucket of this small model:
    ``Manager.allreduce`` sums over the quorum and divides by the replicas taking part (a joining
    replica sends zeros). On an error it reports to the manager and completes without raising,
    so ``should_commit`` turns the step down everywhere (torchft/manager.py, ``_ManagedWork.wait``)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])          # (P,)
    manager.allreduce(flat).wait()
    i = 0
    for g in grads:
        g.copy_(flat[i:i + g.numel()].view_as(g))
        i += g.numel()


def _wait_for_peers(folder, replica, ready):
    """The first life of each replica waits for ``ready`` replicas to have their manager up, so the
    first quorum holds them all (the lighthouse would otherwise start with whoever came first)."""
    open(os.path.join(folder, f"up{replica}"), "a").close()
    deadline = time.time() + 300
    while sum(os.path.exists(os.path.join(folder, f"up{r}")) for r in range(ready)) < ready:
        if time.time() > deadline:
            raise RuntimeError(f"only some of {ready} replicas started within 300 s")
        time.sleep(0.05)


def serve_lighthouse(folder, min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=10000):
    """The lighthouse in a process of its own (so that it can be killed): writes its address."""
    from torchft.coordination import LighthouseServer
    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, quorum_tick_ms=20,
                              heartbeat_timeout_ms=heartbeat_timeout_ms, join_timeout_ms=join_timeout_ms)
    path = os.path.join(folder, "lighthouse")
    with open(path + ".tmp", "w") as f:
        json.dump({"address": server.address(), "pid": os.getpid()}, f)
    os.replace(path + ".tmp", path)
    while True:
        time.sleep(1)


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("One replica group of the torchft lab (python -m labs.failures.torchft_run starts "
                   "them), or with --serve-lighthouse the lighthouse.", world_size_default=None)
    p.add_argument("--folder", required=True, help="where the logs go")
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--lighthouse", help="the lighthouse's address")
    p.add_argument("--steps", type=cli.positive_int, default=20)
    p.add_argument("--step-s", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--ready", type=cli.positive_int, default=3, help="replicas the first quorum waits for")
    p.add_argument("--ddp-wrapper", action="store_true", help="torchft's DistributedDataParallel "
                   "instead of Manager.allreduce after backward")
    p.add_argument("--quorum-timeout", type=float, default=None, help="seconds a quorum may take "
                   "(default: --timeout)")
    p.add_argument("--serve-lighthouse", action="store_true")
    p.add_argument("--heartbeat-timeout-ms", type=cli.positive_int, default=1000)
    args = cli.parse(p, argv)
    if args.serve_lighthouse:
        serve_lighthouse(args.folder, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    if not args.lighthouse:
        raise ValueError("--lighthouse is needed to train (or pass --serve-lighthouse).")
    train(args.replica, args.lighthouse, args.folder, args.steps, args.step_s, args.timeout, args.ready,
          args.ddp_wrapper, args.quorum_timeout)
    cli.report({"replica": args.replica}, args, f"replica {args.replica} finished")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
