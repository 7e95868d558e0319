"""tools/memory_viewer.py: PyTorch's memory viewer (MemoryViz.js) opens the tiny model's snapshot offline.

The page is written into a temporary folder and opened in headless Chromium with every request
outside that folder blocked. Checked: no console error, no blocked request (the five skypack
imports are mapped to the local shim, d3 is the local d3.min.js); the viewer drew its timeline
(SVG polygons, one per tensor); a wheel over the plot zooms it and a drag across the minimap
brushes it (both listeners read `d3.event`, through the shim); the peak its y axis is scaled to
equals `Recorder`'s peak bytes. Skipped where playwright, Chromium or the cached MemoryViz.js /
d3 tarball is missing.
"""
import asyncio
import os
import pickle
import sys

import pytest

pytest.importorskip("playwright", reason="playwright is not installed: no browser check on this machine")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_site  # noqa: E402
import memory_viewer  # noqa: E402


def test_memory_viewer_offline(tmp_path):
    chromium = check_site.find_chromium(None)
    if chromium is None:
        pytest.skip("no Chromium on this machine")
    for name in ("MemoryViz.js", memory_viewer.D3[0]):
        if not os.path.isfile(os.path.join(memory_viewer.CACHE, name)):
            pytest.skip(f"{name} is not in {memory_viewer.CACHE} (MemoryViz.js: pytorch/pytorch's "
                        f"{memory_viewer.PATH} at {memory_viewer.COMMIT[:12]}, not committed)")
    snapshot, peak = memory_viewer.record_tiny_step()
    assert pickle.loads(snapshot)["device_traces"][0]
    assert snapshot[:2] == b"\x80\x04"            # protocol 4: MemoryViz.js reads 2 to 4
    folder = tmp_path / memory_viewer.SITE_FOLDER
    memory_viewer.write(str(folder), snapshot=snapshot)
    seen = asyncio.run(memory_viewer.open_page(str(folder), chromium, interact=True))
    assert seen["errors"] == [] and seen["blocked"] == [], seen
    assert seen["svgs"] == 2 and seen["polygons"] > 100 and seen["elements"] > 100, seen
    # d3.event reached MemoryViz.js's zoom and brush listeners (through the shim's proxy)
    assert seen["zoomed"] and "scale" in seen["zoomed"], seen["zoomed"]
    assert seen["brushed"] and "scale" in seen["brushed"], seen["brushed"]
    assert seen["peaks"] and all(round(p) == peak for p in seen["peaks"]), (seen["peaks"], peak)
