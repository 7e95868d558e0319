"""Sphinx extension (loaded by _config.yml) and command: the book's own memory-timeline viewer.

PyTorch's memory viewer (MemoryViz.js) cannot ship with the site: it is in no package registry
and not in the torch wheel, and the book commits only its own code (tools/memory_viewer.py builds
PyTorch's page offline for a reader who has the file). So the site draws the same snapshot format
with its own small viewer, `memory_timeline_static/memory-timeline.js`: the live bytes after every
allocation and free, one band per block stacked in allocation order, the peak marked, and the
block under the pointer named with its size and the operator that made it. It replays the events
exactly as `labs.measure.memory_snapshot.replay` does, so the peak it prints is that function's.

A page embeds a snapshot with a raw HTML block naming a file of book/data/memory/:

    ```{raw} html
    <div class="dtm-memory" data-snapshot="15-tiny-step"></div>
    ```

On such a page (and only there) the viewer and each named snapshot are added as scripts. A
snapshot travels as `_static/memory-<name>.js`, a script that registers the JSON, because a page
opened from a folder (file://) may not fetch a file but may load a script.

    python tools/memory_timeline.py   # re-records book/data/memory/15-tiny-step.json

The recorded file is `_dump_snapshot`'s dict with each event's ``time_us`` left out: the viewer's
x axis is the event index, and the file is then the same on every run of the same torch.
"""
import json
import os
import pickle
import re
import shutil
import sys

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
ASSETS = os.path.join(TOOLS, "memory_timeline_static")
DATA = os.path.join(ROOT, "book", "data", "memory")
MARKER = re.compile(r'class="dtm-memory" data-snapshot="([\w.-]+)"')
TINY = "15-tiny-step"


def portable(snapshot, torch_version):
    """The snapshot as the site ships it: no wall-clock times, the torch that recorded it named."""
    events = [{k: v for k, v in e.items() if k != "time_us"} for e in snapshot["device_traces"][0]]
    return {"torch": torch_version, "segments": snapshot["segments"], "device_traces": [events]}


def record_tiny():
    """(the portable snapshot of chapter 15's tiny AdamW step, its recorded peak bytes)."""
    sys.path.insert(0, TOOLS)
    import memory_viewer  # noqa: E402  (tools/ is not a package)
    import torch

    data, peak = memory_viewer.record_tiny_step()
    return portable(pickle.loads(data), torch.__version__.split("+")[0]), peak


def load(name):
    with open(os.path.join(DATA, name + ".json")) as f:
        return json.load(f)


def add_assets(app, pagename, templatename, context, doctree):
    names = MARKER.findall(context.get("body", ""))
    if not names:
        return
    app.add_css_file("memory-timeline.css")
    for name in dict.fromkeys(names):  # the data first: deferred scripts run in order
        if not os.path.exists(os.path.join(DATA, name + ".json")):
            raise FileNotFoundError(f"{pagename} names the snapshot {name!r}, not in book/data/memory/")
        app.add_js_file(f"memory-{name}.js", loading_method="defer")
        app.dtm_snapshots.add(name)
    app.add_js_file("memory-timeline.js", loading_method="defer")


def copy_files(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    static = os.path.join(app.outdir, "_static")
    for name in os.listdir(ASSETS):
        shutil.copyfile(os.path.join(ASSETS, name), os.path.join(static, name))
    for name in sorted(app.dtm_snapshots):
        with open(os.path.join(static, f"memory-{name}.js"), "w") as f:
            f.write("(window.dtmMemory = window.dtmMemory || {})[%s] = %s;\n"
                    % (json.dumps(name), json.dumps(load(name), separators=(",", ":"))))


def setup(app):
    app.dtm_snapshots = set()
    # before offline_site's drop_thebe (priority 500), which gives the page a new list of scripts
    app.connect("html-page-context", add_assets, priority=400)
    app.connect("build-finished", copy_files)
    return {"parallel_read_safe": True, "parallel_write_safe": False}


def main():
    snapshot, peak = record_tiny()
    os.makedirs(DATA, exist_ok=True)
    path = os.path.join(DATA, TINY + ".json")
    with open(path, "w") as f:
        json.dump(snapshot, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.relpath(path, ROOT)}: {len(snapshot['device_traces'][0])} events, "
          f"peak {peak:,} bytes, torch {snapshot['torch']}")


if __name__ == "__main__":
    main()
