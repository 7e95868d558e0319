"""The site's memory-timeline viewer (tools/memory_timeline.py) and the snapshot it ships.

- the committed snapshot is what recording chapter 15's tiny step writes today, byte for byte,
  where the installed torch is the one that recorded it (another torch may make other storages);
- its replay peaks at the recorded peak (a dropped or doubled event moves the peak);
- in Chromium, the viewer's replay equals `labs.measure.memory_snapshot.replay` event by event (a
  viewer that skipped `free_requested` wrongly, or stacked a free as an allocation, differs), and
  the page states the same peak. Skipped where playwright or Chromium is missing.
"""
import asyncio
import json
import os
import sys

import pytest

from labs.measure import memory_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import memory_timeline  # noqa: E402

SNAPSHOT = memory_timeline.load(memory_timeline.TINY)


def test_the_committed_snapshot_is_todays_recording():
    import torch
    if torch.__version__.split("+")[0] != SNAPSHOT["torch"]:
        pytest.skip(f"recorded with torch {SNAPSHOT['torch']}, this is {torch.__version__}")
    fresh, peak = memory_timeline.record_tiny()
    assert json.loads(json.dumps(fresh)) == SNAPSHOT
    assert memory_snapshot.replay_peak(SNAPSHOT) == peak


def test_a_lost_event_moves_the_replay():
    live = memory_snapshot.replay(SNAPSHOT)
    events = SNAPSHOT["device_traces"][0]
    k = next(i for i, e in enumerate(events) if e["action"] == "free_completed")
    cut = dict(SNAPSHOT, device_traces=[events[:k] + events[k + 1:]])
    assert memory_snapshot.replay(cut) != live
    assert len(live) == 1 + sum(e["action"] in ("alloc", "free_completed") for e in events)


def viewer_page():
    data = json.dumps(SNAPSHOT)
    with open(os.path.join(memory_timeline.ASSETS, "memory-timeline.js")) as f:
        script = f.read()
    return (f'<html><body style="width:900px"><div class="dtm-memory" data-snapshot="tiny"></div>'
            f'<script>(window.dtmMemory = {{}})["tiny"] = {data};</script>'
            f'<script>{script}</script></body></html>')


async def in_chromium(chromium):
    from playwright.async_api import async_playwright
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium)
        try:
            tab = await browser.new_page()
            errors = []
            tab.on("pageerror", lambda e: errors.append(str(e)))
            await tab.set_content(viewer_page())
            live = await tab.evaluate("window.dtmMemoryReplay(window.dtmMemory.tiny).live")
            peak = await tab.get_attribute(".dtm-memory", "data-peak")
            head = await tab.inner_text(".dtm-memory-head")
            return errors, live, peak, head
        finally:
            await browser.close()


def test_the_viewer_replays_as_the_labs_do():
    pytest.importorskip("playwright", reason="playwright is not installed: no browser check here")
    import check_site
    chromium = check_site.find_chromium(None)
    if chromium is None:
        pytest.skip("no Chromium on this machine")
    errors, live, peak, head = asyncio.run(in_chromium(chromium))
    assert not errors
    assert live == memory_snapshot.replay(SNAPSHOT)
    want = memory_snapshot.replay_peak(SNAPSHOT)
    assert int(peak) == want and f"peak {want:,} bytes" in head
