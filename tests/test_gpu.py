"""labs.gpu: the dry run exercises every section on the CPU, measures what a CPU can measure
exactly, skips (never fakes) what needs CUDA, and writes no results file; without --dry-run a
machine without CUDA gets one sentence."""
import io
import json
import os
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
