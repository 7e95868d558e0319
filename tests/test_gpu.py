"""labs.gpu: the dry run exercises every section on the CPU, measures what a CPU can measure
exactly, skips (never fakes) what needs CUDA, and writes no results file; without --dry-run a
machine without CUDA gets one sentence."""
import io
import json
import os
import sys
import time
from contextlib import redirect_stdout

import pytest
import torch

from labs.launcher import cli
from labs.gpu import record

CUDA_ONLY = "skipped: "


@pytest.fixture(scope="module")
def dry():
    """One dry run for the whole file (about 10 s on 2 busy cores), its JSON read back from stdout."""
    before = sorted(os.listdir(record.RESULTS)) if os.path.isdir(record.RESULTS) else None
    out = io.StringIO()
    with redirect_stdout(out):
        record.main(["--dry-run"])
    after = sorted(os.listdir(record.RESULTS)) if os.path.isdir(record.RESULTS) else None
    return json.loads(out.getvalue()), before, after


def _figures(node, path=()):
    """Every figure dict (one with a "kind") and every string leaf, with its path."""
    if isinstance(node, dict):
        if "kind" in node:
            yield path, node
        for k, v in node.items():
            yield from _figures(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _figures(v, path + (i,))
    elif isinstance(node, str) and node.split(":")[0] in ("skipped", "refused", "error"):
        yield path, node


def test_every_section_runs_and_no_file_is_written(dry):
    result, before, after = dry
    assert set(result["sections"]) == set(record.sections())
    assert set(result["seconds"]) == set(record.sections())
    assert before == after                    # a results file only ever comes from a GPU run
    with pytest.raises(ValueError, match="only by a run on a GPU"):
        record.write_results(result, torch.device("cpu"))


def test_figures_are_labelled_and_strings_are_reasons(dry):
    found = list(_figures(dry[0]["sections"]))
    assert len(found) > 50
    for path, f in found:
        if isinstance(f, str):
            assert f.startswith(("skipped: ", "refused: ")) and len(f) > 12, (path, f)
        else:
            assert f["kind"] in ("measured", "formula") and isinstance(f["unit"], str), path
            assert isinstance(f["value"], (int, float)) and f["value"] == f["value"], path


def test_provenance(dry):
    p = dry[0]["provenance"]
    assert set(p) >= {"device", "driver", "cuda", "torch", "python", "date", "git_commit", "command"}
    assert p["command"] == "python -m labs.gpu --dry-run" and p["torch"] == torch.__version__
    assert record.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_materialized_softmax_keeps_korthikanti_bytes_exactly(dry):
    for row in dry[0]["sections"]["activations"]["rows"]:
        # Korthikanti's count plus the LayerNorms' statistics, which the paper leaves out: a block
        # that saved nn.Dropout's bf16 noise instead of a 1-byte mask would be off by 2sbh + as^2b.
        assert row["materialized"]["value"] == row["korthikanti"]["value"] + row["layernorm_stats_bytes"], row
        assert row["korthikanti"]["value"] == row["s"] * row["h"] * (34 + 5 * row["a"] * row["s"] / row["h"])
        math = row["math"]
        if isinstance(math, dict):            # SDPA's math back-end keeps more: fp32 intermediates
            assert math["value"] > row["materialized"]["value"], row
        for backend in ("flash", "efficient", "cudnn"):
            assert isinstance(row[backend], (dict, str))
        # the memory-efficient and cuDNN kernels exist only on CUDA: recorded as refused, with a reason
        assert row["efficient"].startswith("refused: ") and row["cudnn"].startswith("refused: ")


def test_adam_peak_is_sixteen_bytes_plus_the_derived_term(dry):
    memory = dry[0]["sections"]["adam_step_memory"]
    for variant in ("lab_mixed", "adamw_foreach", "adamw_fused"):
        v = memory[variant]
        for i in (1, 2):
            end, peak = v[f"step{i}_live_storage_end"]["value"], v[f"step{i}_live_storage_peak"]["value"]
            # exact up to AdamW's step counters (one fp32 scalar per parameter tensor): the lab's
            # Adam keeps an int, so its end is exactly 16; a missing temporary would fail here
            assert end == pytest.approx(16, abs=0 if variant == "lab_mixed" else 0.01), (variant, i)
            assert peak - end == pytest.approx(v["peak_term_per_param"], rel=1e-9, abs=1e-9), (variant, i)
            assert v[f"step{i}_peak"].startswith(CUDA_ONLY) and v[f"step{i}_after"].startswith(CUDA_ONLY)


def test_flops_counted_equal_formula_and_cuda_sections_skip(dry):
    s = dry[0]["sections"]
    assert s["mfu"]["flops"]["value"] == s["mfu"]["flops"]["formula_value"]
    for policy in ("none", "full", "selective", "every-k"):
        r = s["recompute"][policy]["time_ratio"]
        assert r["counted_flops_ratio"] == pytest.approx(r["formula_value"], rel=1e-12), policy
    ratio = {p: s["recompute"][p]["time_ratio"]["formula_value"] for p in ("full", "selective")}
    assert ratio["full"] > ratio["selective"] > 1
    for kind in ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
        assert s["bandwidth"][kind].startswith(CUDA_ONLY)
    fp8 = s["fp8"]
    for g in ("tensor", "row"):               # per-row scaling limits the outliers' damage
        if isinstance(fp8[g], dict):
            assert fp8[g]["vs_emulation"] < 2e-2
    if isinstance(fp8["tensor"], dict) and isinstance(fp8["row"], dict):
        assert fp8["row"]["rel_error_vs_fp32"]["value"] < fp8["tensor"]["rel_error_vs_fp32"]["value"]
    assert s["checkpoint"]["bytes_written"]["value"] >= s["checkpoint"]["bytes_written"]["formula_value"]


def test_refuses_in_one_sentence_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        cli.main(lambda: record.main([]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {record.REFUSAL}" and err.count(". ") == 0 and "\n" not in err


# ---- make gpu-check (tools/gpu_check.py): its plan, its runner and report, on the CPU ------------

def _gpu_check():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check",
                                                  os.path.join(record.ROOT, "tools", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_fits_in_eight_minutes_part_by_part():
    gc = _gpu_check()
    plan = gc.parts()
    names = [p[0] for p in plan]
    assert names == ["provenance", "fp8", "smoke", "record", "tests", "ch15"]
    assert sum(p[2] for p in plan) <= gc.BUDGET_S == 480 and all(p[2] > 0 for p in plan)
    ch15 = dict((p[0], p[1]) for p in plan)["ch15"]
    assert (ch15 is None) != os.path.exists(os.path.join(record.ROOT, "labs", "profiling", "opt_exercise.py"))
    assert "tests" not in [p[0] for p in gc.parts(dry_run=True)]   # the dry run never starts the suite


def test_a_part_past_its_limit_is_killed_with_its_children():
    import psutil
    gc = _gpu_check()
    child = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
             "time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)")
    status, seconds, out, _ = gc.run_part([sys.executable, "-c", child], 3)
    assert status == "timed out after 3 s" and seconds < 30
    grandchild = int(out.split()[0])
    # SIGKILL is delivered asynchronously: on a loaded machine the grandchild can still show as
    # running for a moment, so give it a few seconds to die; one that outlives them was missed.
    deadline, status = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        try:
            status = psutil.Process(grandchild).status()
        except psutil.NoSuchProcess:
            break
        if status == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the part's grandchild {grandchild} survived the kill ({status})")
    assert gc.run_part([sys.executable, "-c", "raise SystemExit(3)"], 30)[0] == "failed (exit 3)"


def test_gpu_check_reports_each_part_with_provenance(monkeypatch, tmp_path, capsys):
    gc = _gpu_check()
    py = sys.executable
    monkeypatch.setattr(gc, "parts", lambda dry_run=False: [
        ("provenance", None, 15, None), ("fp8", [py, "-c", "print('{\"gap\": 1}')"], 20, "json"),
        ("smoke", [py, "-c", "raise SystemExit(1)"], 20, "json"), ("ch15", None, 10, "json")])
    assert gc.main(["--dry-run", "--out", str(tmp_path)]) == 1       # one part failed: the run fails
    (path,) = tmp_path.glob("*-check.json")
    r = json.loads(path.read_text())
    assert set(r["provenance"]) >= {"device", "driver", "cuda", "torch", "python", "date", "git_commit"}
    assert r["parts"]["fp8"]["result"] == {"gap": 1} and r["parts"]["fp8"]["status"] == "ok"
    assert (r["parts"]["smoke"]["status"] == "failed (exit 1)"
            and r["parts"]["ch15"]["status"].startswith("skipped"))
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[gpu-check]")]
    assert len(printed) == 5 and all(" s of " in line for line in printed[:4])


def test_gpu_check_refuses_without_cuda(monkeypatch, capsys):
    gc = _gpu_check()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: make gpu-check measures a GPU") and "\n" not in err


def test_a_cut_short_recording_keeps_the_sections_it_finished():
    seen = []
    out = record.record(torch.device("cpu"), record.DRY, ["--dry-run"], only=["bandwidth", "activations"],
                        log=io.StringIO(), after_each=lambda so_far: seen.append((sorted(so_far["sections"]),
                                                                                 so_far["complete"])))
    assert seen == [(["activations"], False), (["activations", "bandwidth"], False)] and out["complete"]


# ---- the box's set-up plan, the world-size-1 smoke run, the notebooks' GPU lines -----------------

def test_box_setup_installs_only_what_a_target_needs_and_the_box_lacks():
    import importlib.util
    spec = importlib.util.spec_from_file_location("box_setup",
                                                  os.path.join(record.ROOT, "tools", "box_setup.py"))
    box = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(box)
    test, lab = box.requirements("test"), box.requirements("lab")
    assert "jupyterlab" in lab and "jupyterlab" not in test and set(test) < set(lab)
    have = {"nbval": "0.10.0", "pytest": "8.3.0", "numpy": "2.1.0", "matplotlib": "3.9.0", "psutil": "6.0"}
    todo = box.missing(lab, installed=have.get)
    assert "nbval==0.11.0" in todo                               # there, but not the version pinned
    assert {"ipykernel", "ipywidgets", "jupyterlab", "pytest-timeout"} <= set(todo)
    assert not {"pytest", "numpy", "matplotlib", "psutil"} & set(todo)


def test_smoke_runs_each_lab_and_names_the_one_that_fails():
    from labs.gpu import smoke
    from labs.launcher import launch
    labs = [("labs.data_parallel.bus_bandwidth.rank_sweep", ([6],), {}),
            ("labs.data_parallel.ring_allreduce.run", (1001,), {"repeats": 1})]
    r = launch.spawn(smoke.run_each, 1, labs)[0]
    bad, good = r["labs"]["labs.data_parallel.bus_bandwidth.rank_sweep"], r["labs"][labs[1][0]]
    assert r["backend"] == "gloo" and good["ok"] and good["seconds"] > 0      # the failure stopped nothing
    assert not bad["ok"] and bad["error"].startswith("ValueError: every size must be a positive "
                                                     "multiple of 4")


def test_notebooks_say_when_there_is_no_gpu_recording_and_show_one_when_there_is(tmp_path):
    from labs.gpu import recorded
    assert recorded.lines(1, str(tmp_path)) == [recorded.NONE_YET]
    prov = {"device": "NVIDIA H100 80GB HBM3", "driver": "580.1", "cuda": "13.0", "torch": "2.11.0",
            "git_commit": "0123456789abcdef", "date": "2026-11-20T10:00:00+00:00"}
    fig = {"value": 16.5, "unit": "bytes/param", "kind": "measured"}
    (tmp_path / "h100.json").write_text(json.dumps({"provenance": prov, "sections": {
        "adam_step_memory": {"lab_mixed": {"step1_peak": fig, "step1_after": fig}},
        "bandwidth": {"h2d_pinned": {"value": 55.0, "unit": "GB/s", "kind": "measured"}}}}))
    (tmp_path / "h100-check.json").write_text(json.dumps({"provenance": prov, "parts": {"smoke": {"result": {
        "backend": "nccl", "labs": {"labs.zero.stages.run": {"ok": True, "seconds": 1.5}},
        "cuda_peak_bytes_by_recipe": {"mixed": 3 * 2**20}}}}}))
    three = recorded.lines(3, str(tmp_path))
    assert "  NVIDIA H100 80GB HBM3, driver 580.1, CUDA 13.0" in three
    assert "  torch 2.11.0, commit 01234567, 2026-11-20T10:00:00+00:00" in three
    assert "  zero.stages.run on nccl: ok, 1.5 s" in three and "  copy h2d_pinned: 55 GB/s" in three
    assert "  Adam step (lab_mixed), peak: 16.5 bytes/param" in three
    assert "  CUDA peak, recipe mixed: 3.0 MiB" in recorded.lines(1, str(tmp_path))
    assert all(len(line) <= 88 for ch in (1, 2, 3) for line in recorded.lines(ch, str(tmp_path)))
    with pytest.raises(ValueError, match="notebooks 1 to 3"):
        recorded.lines(4, str(tmp_path))
