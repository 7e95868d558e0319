"""The GPU figures beside the CPU ones: what results/gpu/*.json holds, as lines a notebook prints.

`make gpu-check` on a GPU box writes results/gpu/<device>.json (`labs.gpu.record`: the book's GPU
figures) and results/gpu/<device>-check.json (`tools/gpu_check.py`: the labs at world size 1 on
NCCL, chapter 15's exercise). `lines(chapter)` picks, for notebooks 1 to 3, the figures of their
chapter from every recording there, each with the device and software it was taken on; with no
recording it returns one line that says so. Nothing here measures: it reads what a GPU run wrote.
"""
import glob
import json
import os

from labs.gpu.record import RESULTS

NONE_YET = "no GPU recording yet: results/gpu/ is empty (make gpu-check on a GPU box fills it)"


def recordings(folder=RESULTS):
    """[(file name, its contents)] for every results/gpu/*.json, in name order."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            out.append((os.path.basename(path), json.load(f)))
    return out


def _get(node, *path):
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _show(fig, scale=1.0, unit=None, fmt=".3g"):
    """A figure as "value unit", a skipped/refused/error reason as it is, a missing one as such."""
    if fig is None:
        return "not recorded"
    if isinstance(fig, str):
        return fig
    return f"{fig['value'] * scale:{fmt}} {unit or fig['unit']}"


def _header(name, rec):
    p = rec.get("provenance") or {}
    commit = (p.get("git_commit") or "?")[:8]
    return [f"{name}:"[:WIDTH],
            f"  {p.get('device')}, driver {p.get('driver')}, CUDA {p.get('cuda')}"[:WIDTH],
            f"  torch {p.get('torch')}, commit {commit}, {p.get('date')}"[:WIDTH]]


def _record_lines(chapter, s):
    """Chapter ``chapter``'s figures from labs.gpu's sections ``s``: (label, value) pairs."""
    out = []
    if chapter == 1:
        out += [("MFU, one ~200M-GPT step", _show(_get(s, "mfu", "mfu"))),
                ("its achieved rate", _show(_get(s, "mfu", "achieved")))]
        row = (_get(s, "activations", "rows") or [{}])[0]
        for kernel in ("materialized", "flash"):
            out.append((f"saved for backward, s={row.get('s')} h={row.get('h')}, {kernel}",
                        _show(row.get(kernel), 2**-20, "MiB")))
    if chapter in (1, 3):
        for variant in ("lab_mixed", "adamw_fused"):
            for when in ("peak", "after"):
                out.append((f"Adam step ({variant}), {when}",
                            _show(_get(s, "adam_step_memory", variant, f"step1_{when}"))))
    if chapter == 3:       # the host link ZeRO-Offload's figures assume (budget.LINKS)
        out += [(f"copy {kind}", _show(_get(s, "bandwidth", kind))) for kind in ("h2d_pinned", "d2h_pinned")]
    return out


SMOKE = {1: ("memory_budget",), 2: ("data_parallel",), 3: ("zero",)}


def _check_lines(chapter, rec):
    """Chapter ``chapter``'s labs at world size 1 on the box's backend, and chapter 15's exercise."""
    out = []
    smoke = _get(rec, "parts", "smoke", "result") or {}
    for name, r in sorted((smoke.get("labs") or {}).items()):
        if name.split(".")[1] in SMOKE[chapter]:
            said = f"ok, {r['seconds']:.1f} s" if r.get("ok") else str(r.get("error"))
            out.append((f"{name.removeprefix('labs.')} on {smoke.get('backend')}", said))
    for recipe, peak in sorted((smoke.get("cuda_peak_bytes_by_recipe") or {}).items()):
        if chapter == 1:
            out.append((f"CUDA peak, recipe {recipe}", "none" if peak is None else f"{peak / 2**20:.1f} MiB"))
    modes = _get(rec, "parts", "ch15", "result", "modes") or {}
    for mode, m in modes.items():
        if (chapter == 2 and mode == "ddp") or (chapter == 3 and mode != "ddp"):
            out.append((f"OPT-1.3B shapes, {mode}, peak per rank", f"{max(m['peak_bytes']) / 2**30:.2f} GiB"))
    return out


WIDTH = 88


def lines(chapter, folder=RESULTS):
    """The lines notebook ``chapter`` (1, 2 or 3) prints under its GPU heading."""
    if chapter not in SMOKE:
        raise ValueError(f"notebooks 1 to 3 show GPU figures; got chapter {chapter}.")
    found = recordings(folder)
    if not found:
        return [NONE_YET]
    out = []
    for name, rec in found:
        body = (_check_lines(chapter, rec) if "parts" in rec
                else _record_lines(chapter, rec.get("sections") or {}))
        out += _header(name, rec)
        out += [f"  {label}: {value}"[:WIDTH] for label, value in body] or ["  nothing for this chapter"]
    return out
