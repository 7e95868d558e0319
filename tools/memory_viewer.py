"""PyTorch's memory viewer, offline, on the tiny model's training step (chapter 15): a reader's tool.

On a GPU, practitioners record the allocator's history (`torch.cuda.memory._record_memory_history()`),
dump it (`_dump_snapshot(path)`) and open the pickle in PyTorch's memory viewer, MemoryViz.js: drag
it onto pytorch.org/memory_viz, or `python -m torch.cuda._memory_viz trace_plot snap.pickle -o
snap.html`, whose page imports MemoryViz.js from cdn.jsdelivr.net (and MemoryViz.js imports d3 from
cdn.skypack.dev). This tool writes the same page with nothing from another host:

- ``MemoryViz.js``: pytorch/pytorch's ``torch/utils/viz/MemoryViz.js``. It is in no package
  registry and not in the torch wheel, and the book does not commit it, so the site does not use
  this tool. Give it with ``--viewer path/to/pytorch/torch/utils/viz/MemoryViz.js`` (a PyTorch
  source checkout), copied as is; or put commit ``COMMIT``'s file in ``.cache/memory_viz/``
  (git-ignored), where it is checked against the pinned sha256 (the screenshot's was that file);
- d3 v5's one-file build, ``dist/d3.min.js`` from npm's ``d3@5.16.0`` (`npm pack`, sha512 pinned,
  cached beside it), loaded as the global ``d3``;
- ``d3-shim.js`` (tools/memory_viz/): the five d3 modules MemoryViz.js imports, as one ES module
  over that global; the page's import map sends the five skypack URLs there, so MemoryViz.js runs
  unchanged;
- ``index.html``: `_memory_viz.py`'s template (``add_local_files([{name, base64}], 'Active Memory
  Timeline')``, the pickle padded to a multiple of 3 bytes as `_format_viz` does), importing
  ``./MemoryViz.js``; the snapshot is `labs.measure.memory_snapshot.Recorder`'s for one AdamW step
  of the tiny model (labs/model.py), a pickle of protocol 4 (MemoryViz.js's own unpickler reads
  protocols 2 to 4), or the reader's own with ``--snapshot snap.pickle``.

    python tools/memory_viewer.py --viewer ~/pytorch/torch/utils/viz/MemoryViz.js [--snapshot snap.pickle]
        # writes _build/memory-viewer/: open its index.html (your own pickle can be dropped on it)
    python tools/memory_viewer.py --screenshot book/images/15-memory-viewer.png   # the book's picture

The screenshot (book/images/15-memory-viewer.png, 1120 x 762 px at 192 dpi) is that page in
headless Chromium with every request outside the folder blocked, MemoryViz.js at ``COMMIT``
unchanged; its axis labels are drawn larger than the page draws them (`SHOT_STYLE`), and the
pointer hovers one 8 KiB block (`HOVER`) so the viewer's caption under the plot names the
Recorder's frame for it (``aten:0:aten.clone.default``). Its y axis is scaled to the snapshot's
peak: tests/test_memory_viewer.py reads that peak back from the ticks and checks it equals
``Recorder.peak_bytes`` to the byte.
"""
import argparse
import asyncio
import base64
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
CACHE = os.path.join(ROOT, ".cache", "memory_viz")
SHIM = os.path.join(TOOLS, "memory_viz", "d3-shim.js")
SITE_FOLDER = "memory-viewer"          # under _build/html
OUT = os.path.join(ROOT, "_build", SITE_FOLDER)
SCREENSHOT = os.path.join(ROOT, "book", "images", "15-memory-viewer.png")

REPO, PATH = "pytorch/pytorch", "torch/utils/viz/MemoryViz.js"
COMMIT = "c4b5ac720f8359f20813826d66b5e880bfdf07ca"
MEMORYVIZ_SHA256 = "c8e54f61f27074a69c366beec6dcb8ba36493545b3f9e340563f06f828d253d2"
# npm pack d3@5.16.0; `npm view d3@5.16.0 dist.integrity`
D3 = ("d3-5.16.0.tgz", "d3@5.16.0",
      "sha512-4PL5hHaHwX4m7Zr1UapXW23apo6pexCgdetdJ5kTmADpG/7T9Gkxw0M0tf/pjoB63ezCCm0u5UaFYy2aMt0Mcw==")
# What MemoryViz.js imports; the import map sends each to the shim.
D3_IMPORTS = ("https://cdn.skypack.dev/d3@5", "https://cdn.skypack.dev/d3-axis@1",
              "https://cdn.skypack.dev/d3-scale@1", "https://cdn.skypack.dev/d3-zoom@1",
              "https://cdn.skypack.dev/d3-brush@1")
VIEW = "Active Memory Timeline"
PLOT_HEIGHT = 576                      # MemoryViz.js's plot: viewBox 0 0 1024 576
VIEWPORT = {"width": 560, "height": 480}   # CSS pixels; shot at twice that, saved at 192 dpi
SCALE = 2


class MemoryVizError(RuntimeError):
    """An asset is missing or fails its check; the message says what to do."""


def _sha512(data):
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


NO_VIEWER = ("MemoryViz.js is not here: pass --viewer path/to/pytorch/torch/utils/viz/MemoryViz.js "
             "from a PyTorch source checkout, or open your snapshot at pytorch.org/memory_viz instead.")


def memoryviz(viewer=None, cache=CACHE):
    """MemoryViz.js's bytes: the reader's file ``viewer`` as is, else the cache's, checked against
    the pinned sha256; neither: `MemoryVizError` saying what to do."""
    if viewer is not None:
        if not os.path.isfile(viewer):
            raise MemoryVizError(f"{viewer} is not a file. {NO_VIEWER}")
        return open(viewer, "rb").read()
    path = os.path.join(cache, "MemoryViz.js")
    if not os.path.isfile(path):
        raise MemoryVizError(NO_VIEWER)
    data = open(path, "rb").read()
    if hashlib.sha256(data).hexdigest() != MEMORYVIZ_SHA256:
        raise MemoryVizError(f"{path} does not have the pinned sha256: delete it, or pass --viewer")
    return data


def d3_files(cache=CACHE):
    """{name: bytes}: d3 v5's d3.min.js and its licence, from the checked npm tarball."""
    path = os.path.join(cache, D3[0])
    if not os.path.isfile(path):
        if shutil.which("npm") is None:
            raise MemoryVizError(f"npm is needed once to fetch {D3[1]} (apt-get install npm), or put "
                                 f"{D3[0]} (from `npm pack {D3[1]}`) into {cache}")
        os.makedirs(cache, exist_ok=True)
        done = subprocess.run(["npm", "pack", D3[1], "--pack-destination", cache, "--silent"],
                              capture_output=True, text=True)
        if done.returncode != 0 or not os.path.isfile(path):
            raise MemoryVizError(f"`npm pack {D3[1]}` failed: {done.stderr.strip()[-200:]}")
    data = open(path, "rb").read()
    if _sha512(data) != D3[2]:
        raise MemoryVizError(f"{path} does not have the pinned sha512: delete it and run again")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
        return {"d3.min.js": t.extractfile("package/dist/d3.min.js").read(),
                "LICENSE-d3.txt": t.extractfile("package/LICENSE").read()}


def _pytorch_license():
    """PyTorch's BSD licence text, from the installed torch's dist-info (MemoryViz.js has no header)."""
    try:
        from importlib import metadata
        dist = metadata.distribution("torch")
        for f in dist.files or ():
            if str(f).endswith("licenses/LICENSE") or str(f).endswith(".dist-info/LICENSE"):
                return f.read_text().encode()
    except Exception:
        pass
    return (f"MemoryViz.js is part of PyTorch ({REPO}), BSD-style licence: "
            f"https://github.com/{REPO}/blob/{COMMIT}/LICENSE\n").encode()


def assets(viewer=None, cache=CACHE):
    """{name: bytes} of everything the page loads besides itself."""
    files = {"MemoryViz.js": memoryviz(viewer, cache), "d3-shim.js": open(SHIM, "rb").read()}
    files.update(d3_files(cache))
    files["LICENSE-pytorch.txt"] = _pytorch_license()
    return files


def record_tiny_step():
    """(pickle bytes, peak bytes): the snapshot of one AdamW step of the tiny model, after a first
    step made the optimizer's state, as chapter 15's notebook records it."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch
    from labs import model as gpt
    from labs.measure import memory_snapshot

    torch.manual_seed(0)
    cfg = gpt.GPTConfig()
    m = gpt.build(cfg)
    opt = torch.optim.AdamW(m.parameters())
    x, y = gpt.synthetic_batch(cfg, 4, seed=0)

    def step():
        loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with memory_snapshot.Recorder(m, opt) as rec:
        step()
    snap = rec.snapshot()
    assert memory_snapshot.replay_peak(snap) == rec.peak_bytes
    return pickle.dumps(snap, protocol=4), rec.peak_bytes


TINY = ("tiny-step.pickle", """PyTorch's memory viewer (MemoryViz.js) on one AdamW step of the book's
tiny model, recorded on the CPU by <code>labs.measure.memory_snapshot.Recorder</code>: live bytes after
every allocation and free, each band one tensor.""")


def page(snapshot, name=TINY[0], note=TINY[1],
         title="PyTorch's memory viewer, offline"):
    """index.html: `_memory_viz.py`'s template with local imports (an import map for d3)."""
    buffer = snapshot + b"\x00" * (3 - len(snapshot) % 3)     # as torch.cuda._memory_viz._format_viz
    files = json.dumps([{"name": name, "base64": base64.b64encode(buffer).decode()}])
    imports = json.dumps({"imports": {url: "./d3-shim.js" for url in D3_IMPORTS}}, indent=1)
    return f"""<!DOCTYPE html>
<!-- Written by tools/memory_viewer.py: PyTorch's MemoryViz.js ({REPO} {PATH} at {COMMIT[:12]},
     LICENSE-pytorch.txt) with d3 v5 from npm (d3.min.js, LICENSE-d3.txt), nothing from another host. -->
<html>
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>html, body {{ height: 100%; margin: 0 8px; font-family: sans-serif; }}
p.dtm-note {{ font-size: 13px; margin: 6px 0; }}</style>
<script src="d3.min.js"></script>
<script type="importmap">
{imports}
</script>
</head>
<body>
<p class="dtm-note">{note} Drag a file onto the page to open your own
<code>_dump_snapshot</code> pickle; nothing leaves your browser.</p>
<script type="module">
import {{add_local_files}} from "./MemoryViz.js"
const local_files = {files}
add_local_files(local_files, {json.dumps(VIEW)})
</script>
</body>
</html>
"""


def write(folder, snapshot=None, files=None, name=None):
    """The page and its files in ``folder`` (made); returns the peak bytes when it recorded.
    ``name``: the reader's snapshot file's name, shown by the viewer."""
    peak = None
    if snapshot is None:
        snapshot, peak = record_tiny_step()
    files = dict(files or assets())
    shown = page(snapshot) if name is None else page(snapshot, name, f"PyTorch's memory viewer "
                                                     f"(MemoryViz.js) on <code>{name}</code>.")
    files["index.html"] = shown.encode()
    os.makedirs(folder, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return peak


# What the page drew: run once the plot's polygons exist. The y axis is d3's axisLeft over
# scaleLinear().domain([0, peak]).range([576, 0]): each tick is drawn at translate(0, y + 0.5)
# (d3-axis 1's half-pixel offset) and carries its value as its datum, so any tick above 0 gives
# the peak the viewer scaled to: value * 576 / (576 - y).
DREW = """() => {
  const svgs = Array.from(document.querySelectorAll('svg'));
  const polygons = document.querySelectorAll('svg polygon').length;
  const elements = svgs.reduce((n, s) => n + s.querySelectorAll('*').length, 0);
  const peaks = Array.from(document.querySelectorAll('svg g.tick')).map(t => {
    const m = /translate\\(0,([-0-9.e]+)\\)/.exec(t.getAttribute('transform') || '');
    return m && t.__data__ > 0 ? t.__data__ * %d / (%d - (parseFloat(m[1]) - 0.5)) : null;
  }).filter(p => p !== null);
  return {svgs: svgs.length, polygons: polygons, elements: elements, peaks: peaks};
}""" % (PLOT_HEIGHT, PLOT_HEIGHT)


async def open_page(folder, chromium="/usr/bin/chromium", screenshot=None, timeout_ms=30_000,
                    interact=False):
    """Open ``folder``/index.html in headless Chromium, every request outside ``folder`` blocked;
    returns {errors, blocked, svgs, polygons, elements, peaks} and takes the screenshot if asked;
    with ``interact``, also wheels over the plot and brushes the minimap: {zoomed, brushed}."""
    from playwright.async_api import async_playwright

    base = f"http://viewer.invalid/{SITE_FOLDER}/"
    names = set(os.listdir(folder))
    blocked, errors = [], []
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--host-resolver-rules=MAP * ~NOTFOUND"])
        try:
            context = await browser.new_context(viewport=VIEWPORT, device_scale_factor=SCALE)

            async def route(r):
                url = r.request.url.split("?")[0].split("#")[0]
                name = url[len(base):] if url.startswith(base) else None
                if name == "":
                    name = "index.html"
                if name in names:
                    kind = "text/html" if name.endswith(".html") else "text/javascript" \
                        if name.endswith(".js") else "text/plain"
                    with open(os.path.join(folder, name), "rb") as f:
                        await r.fulfill(body=f.read(), content_type=kind)
                else:
                    blocked.append(r.request.url)
                    await r.abort("blockedbyclient")

            await context.route("**/*", route)
            page_ = await context.new_page()
            page_.on("pageerror", lambda e: errors.append(str(e)))
            page_.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            await page_.goto(base + "index.html")
            try:
                await page_.wait_for_function(
                    "document.querySelectorAll('svg polygon').length > 1", timeout=timeout_ms)
            except Exception:
                errors.append("the viewer drew no plot")
            await page_.wait_for_timeout(200)
            drew = await page_.evaluate(DREW)
            if interact:      # d3.event through the shim: the zoom's and the brush's listeners
                drew["zoomed"], drew["brushed"] = await _interact(page_)
            if screenshot:
                await _shoot(page_, screenshot)
        finally:
            await browser.close()
    return dict(drew, errors=errors, blocked=blocked)


async def _interact(page_):
    """Wheel over the plot (its zoom listener reads d3.event.transform), then drag across the
    minimap (its brush listener reads d3.event.selection); each leaves a transform on a group."""
    svgs = await page_.evaluate("""() => Array.from(document.querySelectorAll('svg'),
        s => { const r = s.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })""")
    (x, y, w, h), (mx, my, mw, mh) = svgs[0], svgs[1]
    await page_.mouse.move(x + w / 2, y + h / 2)
    await page_.mouse.wheel(0, -300)
    await page_.wait_for_timeout(300)
    zoomed = await page_.evaluate("""() => document.querySelector('svg g[clip-path] > g')
        .getAttribute('transform')""")
    await page_.mouse.move(mx + mw * 0.3, my + mh / 2)
    await page_.mouse.down()
    await page_.mouse.move(mx + mw * 0.6, my + mh / 2, steps=4)
    await page_.mouse.up()
    await page_.wait_for_timeout(100)
    brushed = await page_.evaluate("""() => document.querySelector('svg g[clip-path] > g > g')
        .getAttribute('transform')""")
    return zoomed, brushed


# The screenshot only: MemoryViz.js draws its axis labels 10 units high in a 1024-wide viewBox,
# under 5 px on a phone, so the shot draws them larger; and it hovers over the tensor at HOVER
# (fractions of the plot) so the viewer's own caption under the plot names it (size, operator).
SHOT_STYLE = "svg g.tick text { font-size: 26px; }"
HOVER = (0.3, 0.43)


async def _shoot(page_, path):
    await page_.add_style_tag(content=SHOT_STYLE)
    box = await page_.evaluate("""() => {
        const svg = document.querySelector('svg').getBoundingClientRect();
        const top = document.querySelector('select').getBoundingClientRect().top;
        return {x: svg.x, y: svg.y, w: svg.width, h: svg.height, top: top}; }""")
    left = box["x"] + box["w"] * 70 / 1024                   # the plot starts after left_pad 70
    await page_.mouse.move(left + (box["w"] - left + box["x"]) * HOVER[0], box["y"] + box["h"] * HOVER[1])
    await page_.wait_for_timeout(100)
    bottom = await page_.evaluate("""() => {
        const pre = Array.from(document.querySelectorAll('pre')).pop();
        const r = document.createRange(); r.selectNodeContents(pre);
        return r.getBoundingClientRect().bottom; }""")
    await page_.screenshot(path=path, clip={"x": 0, "y": box["top"] - 4, "width": VIEWPORT["width"],
                                            "height": min(VIEWPORT["height"], bottom + 6) - box["top"] + 4})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--viewer", help="MemoryViz.js from a PyTorch source checkout "
                    "(torch/utils/viz/MemoryViz.js); default: the cache's pinned copy")
    ap.add_argument("--snapshot", help="your own _dump_snapshot pickle (default: the tiny model's step)")
    ap.add_argument("--out", default=OUT, help="folder for the page (default _build/memory-viewer)")
    ap.add_argument("--screenshot",
                    help=f"also take the picture (the book's: {os.path.relpath(SCREENSHOT, ROOT)})")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args(argv)
    snapshot = name = None
    if args.snapshot:
        with open(args.snapshot, "rb") as f:
            snapshot, name = f.read(), os.path.basename(args.snapshot)
    try:
        peak = write(args.out, snapshot=snapshot, files=assets(args.viewer), name=name)
    except MemoryVizError as e:
        sys.exit(f"error: {e}")
    print(f"{args.out}/index.html" + ("" if peak is None else f": peak {peak} bytes"))
    if not args.screenshot:
        return
    os.makedirs(os.path.dirname(args.screenshot), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        shot = os.path.join(tmp, "shot.png")
        seen = asyncio.run(open_page(args.out, args.chromium, screenshot=shot))
        if seen["errors"] or seen["blocked"]:
            sys.exit(f"the viewer failed: {seen['errors'][:3]}, blocked {seen['blocked'][:3]}")
        print({k: v for k, v in seen.items() if k != "peaks"}, "peak from the axis:", seen["peaks"][:1])
        from PIL import Image
        Image.open(shot).save(args.screenshot, dpi=(96 * SCALE, 96 * SCALE), optimize=True)
    print(args.screenshot)


if __name__ == "__main__":
    main()
