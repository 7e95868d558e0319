"""Chapter 15: Holistic Trace Analysis (HTA, facebookresearch/HolisticTraceAnalysis) on the same
traces, for what it supports.

HTA's breakdowns are built on GPU kernels: ``get_temporal_breakdown`` splits each rank's GPU time
into compute, non-compute and idle kernels' time, ``get_comm_comp_overlap`` gives the share of
NCCL kernel time that overlaps compute kernels, ``get_idle_time_breakdown`` explains GPU idle
time. A CPU trace has no kernels: on one, the first fails and the second returns NaN (measured
with HTA 0.5.0). What HTA does on a CPU trace is read it: `parsed` checks that HTA and
`labs.profiling.trace` read the same communication events, count and time. On a GPU trace,
`gpu_crosscheck` sets HTA's temporal breakdown and overlap beside `labs.profiling.analysis`'s
(the GPU recording command can call it on the traces a GPU run writes).
"""
import contextlib
import io

from labs.profiling import analysis, trace


def _analysis(folder):
    from hta.trace_analysis import TraceAnalysis
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return TraceAnalysis(trace_dir=folder)


def parsed(folder, prefix=analysis.SPANS):
    """Per rank, the communication events (names starting with ``prefix``) as HTA and as this
    package read them: {rank: {name: {"hta": (count, µs), "labs": (count, µs)}}}. HTA rounds each
    event's start up and its end down to whole microseconds (``round_down_time_stamps`` in its
    trace parser), so its sum is lower, by less than two microseconds per event."""
    hta = _analysis(folder)
    ids = hta.t.symbol_table.get_sym_id_map()
    names = {i: n for n, i in ids.items() if n.startswith(prefix)}
    out = {}
    for t in trace.load_folder(folder):
        df = hta.t.get_trace(t["rank"])
        rows = {}
        for i, name in names.items():
            sel = df[df["name"] == i]
            if len(sel):
                rows[name] = {"hta": (len(sel), float(sel["dur"].sum()))}
        for e in t["events"]:
            if e["ph"] == "X" and e["name"].startswith(prefix):
                count, total = rows.setdefault(e["name"], {}).get("labs", (0, 0.0))
                rows[e["name"]]["labs"] = (count + 1, total + e["dur"])
        out[t["rank"]] = dict(sorted(rows.items()))
    return out


def agree(rows):
    """True when HTA and this package count the same events and HTA's total is lower by less than
    two microseconds per event (its rounding of both ends), never higher."""
    for row in rows.values():
        if "hta" not in row or "labs" not in row or row["hta"][0] != row["labs"][0]:
            return False
        n, diff = row["labs"][0], row["labs"][1] - row["hta"][1]
        if not -1e-6 <= diff < 2 * n:
            return False
    return True


def gpu_crosscheck(folder):
    """On a GPU run's traces: HTA's temporal breakdown and communication/computation overlap per rank,
    beside this package's kernel-based terms summed over the step windows. HTA takes every kernel
    of the trace, the lab only those inside its steps: compare shares, and expect HTA's times to
    be the larger. None on CPU traces."""
    traces = trace.load_folder(folder)
    if not any(e["cat"] in analysis.KERNELS for e in traces[0]["events"]):
        return None
    hta = _analysis(folder)
    with contextlib.redirect_stdout(io.StringIO()):
        temporal = hta.get_temporal_breakdown(visualize=False)
        overlap = hta.get_comm_comp_overlap(visualize=False)
    ours = [analysis.totals(rows) for rows in analysis.analyze(traces)]
    out = {}
    for rank, mine in enumerate(ours):
        t = temporal[temporal["rank"] == rank].iloc[0]
        o = overlap[overlap["rank"] == rank].iloc[0]
        out[rank] = {"hta_compute_us": float(t["compute_time(us)"]), "hta_idle_us": float(t["idle_time(us)"]),
                     "hta_overlap_pct": float(o["comp_comm_overlap_pctg"]),
                     "labs_compute_us": mine["compute_s"] * 1e6, "labs_idle_us": mine["idle_s"] * 1e6,
                     "labs_overlap_pct": None if mine["overlap_fraction"] is None
                     else 100 * mine["overlap_fraction"]}
    return out
