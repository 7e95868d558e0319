"""The GPU box's path, checked on a CPU: what would crash or mislead on a box with one or more GPUs.

Each test fakes the part of the machine it needs (a GPU count, torch.cuda's counters, a device
name) and checks the decision or the order of calls that a GPU run depends on. What only a GPU can
show (a kernel's real numbers, NCCL itself) is run by `make gpu-check` (tools/gpu_check.py).
"""
import os
import sys

import pytest
import torch

from labs.failures import elastic
from labs.gpu import speed
from labs.hardware import machine
from labs.launcher import launch, preflight, torchrun
from labs.measure import memory, timing

import box_workers
import workers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the test run itself: gloo before any fixture, results back on the CPU ---------------------

@pytest.fixture(scope="module")
def backend_seen_by_a_module_fixture():
    # built before any function-scoped fixture: a backend set by one of those would come too late
    return os.environ.get(preflight.BACKEND_ENV)


def test_module_scoped_fixtures_already_see_gloo(backend_seen_by_a_module_fixture):
    assert backend_seen_by_a_module_fixture == "gloo"


def test_results_are_loaded_onto_the_cpu(monkeypatch):
    seen = []
    load = torch.load
    monkeypatch.setattr(launch.torch, "load", lambda *a, **k: seen.append(k) or load(*a, **k))
    assert launch.spawn(workers.print_then_return, 1) == [0]
    assert seen and all(k.get("map_location") == "cpu" for k in seen), seen


# ---- the backend choice, with fake GPU counts ---------------------------------------------------

def _gpus(monkeypatch, n):
    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(preflight.torch.cuda, "device_count", lambda: n)


@preflight.on_cpu("a test's CPU-only rank function")
def _cpu_lab(rank, world_size):
    return rank


@pytest.mark.parametrize("gpus, world_size, want",
                         [(1, 1, "nccl"), (1, 2, "gloo"), (8, 8, "nccl"), (0, 1, "gloo")])
def test_nccl_exactly_when_every_rank_has_a_gpu(monkeypatch, gpus, world_size, want):
    monkeypatch.delenv(preflight.BACKEND_ENV)
    _gpus(monkeypatch, gpus)
    assert preflight.choose_backend(world_size) == want
    assert preflight.choose_backend(world_size, fn=_cpu_lab) == "gloo"


def test_a_cpu_lab_gets_gloo_even_when_nccl_is_asked_for(monkeypatch):
    _gpus(monkeypatch, 8)
    monkeypatch.setenv(preflight.BACKEND_ENV, "nccl")
    assert preflight.choose_backend(2) == "nccl"
    assert preflight.choose_backend(2, fn=_cpu_lab) == "gloo"          # the lab's need beats the default
    with pytest.raises(ValueError, match=r"_cpu_lab runs on the CPU \(a test's CPU-only"):
        preflight.choose_backend(2, backend="nccl", fn=_cpu_lab)


# ---- torchrun from this interpreter, with the caller's PYTHONPATH kept --------------------------

def test_torchrun_is_this_interpreters_module_and_pythonpath_is_prepended(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/box/site", REPO]))
    env = torchrun.child_env(REPO, LOGLEVEL="INFO")
    assert env["PYTHONPATH"].split(os.pathsep) == [REPO, "/box/site"] and env["LOGLEVEL"] == "INFO"
    cmd = elastic.torchrun_command("/tmp/f", 2, 1, 8, 3, 5, 1)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and cmd[3] == "--standalone"
    shown = machine.two_node_commands(["labs.x"], 8)        # what a reader types on two machines
    assert [c[:2] for c in shown] == [["torchrun", "--nnodes=2"]] * 2


@pytest.mark.parametrize("visible, want", [(["0", "1", "2", "3"], ["0,1", "2,3"]),
                                           (["4", "5", "6", "7", "0"], ["4,5", "6,7"]),
                                           (["0", "1", "2"], ["", ""]), ([], ["", ""])])
def test_two_launchers_never_share_a_gpu(visible, want):
    assert machine.launcher_gpus(2, 2, visible) == want


# ---- the CUDA peak and the clock, with torch.cuda faked -----------------------------------------

def test_each_recipes_cuda_peak_is_reset_before_its_step():
    r = launch.spawn(box_workers.peak_reset_order, 1, ("mixed", "fp32"))[0]
    one = ["synchronize", "reset_peak_memory_stats", "batch", "synchronize", "max_memory_allocated"]
    assert r["log"] == one * 2 and r["peaks"] == [12345, 12345]


def test_timed_regions_end_after_the_gpu_work(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)

    class Stream:
        def synchronize(self):
            log.append("sync")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(timing.time, "perf_counter", lambda: log.append("clock") or 1.0)
    assert timing.now() == 1.0 and log == ["sync", "clock"]


def test_without_cuda_the_clock_is_read_without_waiting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: pytest.fail("no CUDA: nothing to wait for"))
    assert timing.now() > 0 and memory.cuda_peak_bytes() is None


# ---- datasheet peaks: the whole device name --------------------------------------------------------

@pytest.mark.parametrize("name, known", [("NVIDIA H100 80GB HBM3", True), ("NVIDIA H200", True),
                                         ("NVIDIA H200 NVL", False), ("NVIDIA H100 PCIe", False),
                                         ("NVIDIA H100 NVL", False), ("cpu", False)])
def test_a_peak_belongs_to_one_device_name(name, known):
    assert (speed.peak_of(name) is not None) == known


# ---- the FP8 probe on a GPU: the scales' layout and the gap's bound ------------------------------

def _size_stride(t, dim, size, stride):
    """ScaledBlas.cpp's check_size_stride: the size, and the stride wherever the size is above 1."""
    return t.size(dim) == size and (size <= 1 or t.stride(dim) == stride)


def _cuda_accepts_blockwise(a, b, sa, sb):
    """ScaledBlas.cpp's 1x128 x 128x128 test, in Python: a (M, K) with scale_a, b.t() (N, K) with
    scale_b.t()."""
    m, k = a.shape
    n = b.shape[1]
    one = sa.dim() == 2 and _size_stride(sa, 0, m, 1) and _size_stride(sa, 1, -(-k // 128), m)
    t = sb.t()
    block = (t.dim() == 2 and _size_stride(t, 0, -(-n // 128), -(-k // 128))
             and _size_stride(t, 1, -(-k // 128), 1))
    return one and block


@pytest.mark.parametrize("m, k, n", [(256, 512, 256), (128, 1024, 384)])
def test_blockwise_scales_are_in_the_layout_cuda_checks(m, k, n):
    from labs.precision import fp8, kernels
    x, w = fp8.activations(m, k), torch.randn(n, k) / 16
    (xq, ex), (wq, ew) = fp8.quantize(x, "1x128"), fp8.quantize(w, "128x128")
    sa, sb = kernels.blockwise_scales(ex, ew)
    assert _cuda_accepts_blockwise(xq, wq.t(), sa, sb)
    assert torch.equal(sa, 1 / ex[:, ::128]) and torch.equal(sb, (1 / ew[::128, ::128]).t())
    # the layout the probe used to build: the same values row-major, which CUDA refuses
    assert not _cuda_accepts_blockwise(xq, wq.t(), sa.contiguous(), sb.contiguous())


@pytest.mark.numerics
def test_the_hopper_bound_holds_the_kernel_and_catches_misplaced_scales():
    """The bound a GPU's gap must stay under (14-bit partial sums over 128 products, then fp32) is
    computed from the operands; scales of the wrong tile or block, or encoding scales given for
    decoding ones, exceed it (tests/test_fp8.py holds the CPU kernels' gap under GAP_BOUND)."""
    import math
    from labs.precision import fp8, kernels
    x = fp8.activations(256, 512, seed=0)
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) / math.sqrt(512)
    A, B = kernels.dequantized("blockwise", x, w)
    bound = kernels.cuda_gap_bound(A, B)
    assert kernels.GAP_BOUND < bound < 0.1
    (xq, ex), (wq, ew) = fp8.quantize(x, "1x128"), fp8.quantize(w, "128x128")
    ref = A @ B.t()

    def gap(y):
        return ((y - ref).norm() / ref.norm()).item()
    wrong = {"X tile scales one tile over": (xq.float() * (1 / ex).roll(128, 1)).double() @ B.t(),
             "W block scales one block over": A @ (wq.float() * (1 / ew).roll(128, 0)).double().t(),
             "encoding scales": (xq.float() * ex).double() @ (wq.float() * ew).double().t()}
    for what, y in wrong.items():
        assert gap(y) > bound, what


def test_the_probe_tries_the_gpu_where_there_is_one(monkeypatch):
    from labs.precision import kernels
    real = torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    r = kernels.try_kernels(M=128, K=512, N=128)
    assert r["device"] == "cuda"
    for name, v in r["kernels"].items():
        assert v["gap_bound"] > kernels.GAP_BOUND, name        # the GPU's own, derived bound
        if not real:                                            # a CPU build: every kernel refused
            assert not v["ran"] and "CUDA" in v["error"], (name, v["error"])
        elif v["ran"]:                                          # on a GPU box: the real check
            assert v["gap"] < v["gap_bound"], (name, v)


# ---- every clock read in labs/ is timing.now, or here with the reason it times no GPU work --------

HOST_CLOCK_OK = {
    **dict.fromkeys(["labs/launcher/_rank.py", "labs/launcher/heartbeat.py", "labs/launcher/hello.py",
                     "labs/launcher/launch.py", "labs/launcher/supervise.py", "labs/launcher/torchrun.py",
                     "labs/launcher/zygote.py", "labs/checkpointing/checkpoint_faults.py",
                     "labs/failures/elastic.py", "labs/failures/elastic_worker.py",
                     "labs/failures/scenarios.py"],
                    "deadlines and process events, not GPU work"),
    "labs/measure/timing.py": "the helper itself",
    "labs/threed/seeds.py": "the sweep's wall time in its provenance record, run by hand, no GPU work",
    "labs/data_parallel/hand_ddp.py": "the bucket timeline, read by ddp.overlap_on_off, which is on_cpu",
    "labs/hardware/machine.py": "a host memcpy, the on_cpu ping-pong; its GPU copies synchronize",
    "labs/pipeline/executor.py": "on_cpu: a CPU emulation of pipeline timing",
    "labs/pipeline/pipeline_dp.py": "on_cpu: chapter 5's executor",
    "labs/pipeline/stage_balance.py": "one process on CPU tensors",
    "labs/recompute/policies.py": "one process on CPU tensors",
    **dict.fromkeys(["labs/hardware/latency.py"],
                    "not yet: CPU tensors or gloo today (tests/test_devices.py NOT_AUDITED); timing.now "
                    "when they move to launch.device()"),
    **dict.fromkeys(["labs/failures/silent_faults.py", "labs/failures/slow_link.py",
                     "labs/failures/stragglers.py", "labs/checkpointing/async_checkpoint.py"],
                    "on_cpu: chapter 12's and 13's CPU labs"),
    **dict.fromkeys(["labs/failures/torchft_replica.py", "labs/failures/torchft_run.py",
                     "labs/launcher/under_load.py"],
                    "process start-up and wall-clock event times compared across processes, no GPU work"),
}


def test_timed_regions_read_the_clock_through_timing_now():
    import glob
    import re
    clock = re.compile(r"\btime\.(perf_counter|time|monotonic)\(\)")
    found = set()
    for path in glob.glob(os.path.join(REPO, "labs", "**", "*.py"), recursive=True):
        with open(path) as f:
            if clock.search(f.read()):
                found.add(os.path.relpath(path, REPO))
    assert found - set(HOST_CLOCK_OK) == set(), "read labs.measure.timing.now() instead, or say why not here"
    assert set(HOST_CLOCK_OK) - found == set(), "no longer reads the host clock: drop it from HOST_CLOCK_OK"
