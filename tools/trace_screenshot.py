"""A screenshot of one of the book's traces in a real trace viewer, made offline (chapter 15).

The viewer is catapult's trace viewer, the one chrome://tracing opens (deprecated in favour of
Perfetto, to which it now redirects by default): its one-file build ``trace_viewer_full.html`` as
vendored by PyTorch's TensorBoard plugin (PyPI ``torch-tb-profiler``), with the Web Components v0
polyfill it needs in today's browsers (npm ``webcomponents.js``). Both are fetched once by their
registries' own clients (`pip download`, `npm pack`) into ``.cache/trace_viewer/`` (git-ignored),
checked against the pinned hashes below before anything is unpacked; a machine without network makes
the screenshot from a cache filled once.

The trace is chapter 15's committed DDP trace (notebooks/traces/15/ddp), its two ranks merged into
one file, one process per rank (`labs.profiling.practice.merge_traces`). The page
(tools/trace_viewer/viewer.html) opens it in headless Chromium driven by playwright, every request
outside the page's own files blocked, zooms on rank 0's last ``gloo:all_reduce`` and the 7.5 ms
before it (the gap where rank 0's thread waits while gloo's threads run the all-reduce), and the
screenshot is cropped to the tracks (from the time ruler down; toolbar and panels left out):
1000 x 752 px at 192 dpi, slice names about 7 px high at 390 px, rank 0's threads and the top of
rank 1's. The zoom must wait: catapult sets its own whole-trace view from a poll
(``pollIfViewportAttached_``) once its canvas is attached, which would overwrite the page's zoom,
so viewer.html waits for that poll to end and then sets the display transform in canvas (device)
pixels. The picture is static (one run's traces); the chapter quotes no number from it.

    python tools/trace_screenshot.py          # writes book/images/15-trace-viewer.png
"""
import argparse
import asyncio
import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CACHE = os.path.join(ROOT, ".cache", "trace_viewer")
PAGE = os.path.join(ROOT, "tools", "trace_viewer", "viewer.html")
OUT = os.path.join(ROOT, "book", "images", "15-trace-viewer.png")
TRACES = os.path.join(ROOT, "notebooks", "traces", "15", "ddp")
# pip download --no-deps torch-tb-profiler==0.4.3; sha256 of the wheel (PyPI's digest)
WHEEL = ("torch_tb_profiler-0.4.3-py3-none-any.whl", "torch-tb-profiler==0.4.3",
         "207a49b05572dd983e4ab29eb5e0fcadd60374a8f93c78ec638217e8d18788dc")
# npm pack webcomponents.js@0.7.24; `npm view webcomponents.js@0.7.24 dist.integrity`
POLYFILL = ("webcomponents.js-0.7.24.tgz", "webcomponents.js@0.7.24",
            "sha512-YICWfSBmTB1mkhYlSqfTBN6vtunG+sacpzDF13K7fXsj03BGB3QfETF7f0fuMV/P/4GwSr4yiRNeeRk91p5tUg==")
VIEWPORT = {"width": 500, "height": 400}   # CSS pixels; shot at twice that, saved at 192 dpi:
# 1000 px shown 390 wide keeps the slices' 9-px names about 7 px high on a phone
SCALE = 2


def _fetch(name, spec, command):
    path = os.path.join(CACHE, name)
    if not os.path.isfile(path):
        os.makedirs(CACHE, exist_ok=True)
        subprocess.run(command + [spec], cwd=CACHE, check=True)
    return open(path, "rb").read()


def assets():
    """{file name: bytes} of the viewer's two files, from the checked cache."""
    wheel = _fetch(WHEEL[0], WHEEL[1], [sys.executable, "-m", "pip", "download", "--no-deps", "-d", CACHE])
    if hashlib.sha256(wheel).hexdigest() != WHEEL[2]:
        sys.exit(f"{WHEEL[0]} does not have the pinned sha256: delete {CACHE} and run again")
    if not shutil.which("npm") and not os.path.isfile(os.path.join(CACHE, POLYFILL[0])):
        sys.exit("npm is needed once to fetch webcomponents.js (apt-get install npm)")
    tgz = _fetch(POLYFILL[0], POLYFILL[1], ["npm", "pack", "--silent"])
    if "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode() != POLYFILL[2]:
        sys.exit(f"{POLYFILL[0]} does not have the pinned sha512: delete {CACHE} and run again")
    with zipfile.ZipFile(io.BytesIO(wheel)) as z:
        viewer = z.read("torch_tb_profiler/static/trace_viewer_full.html")
    with tarfile.open(fileobj=io.BytesIO(tgz)) as t:
        polyfill = t.extractfile("package/webcomponents.min.js").read()
    return {"trace_viewer_full.html": viewer, "webcomponents.min.js": polyfill,
            "viewer.html": open(PAGE, "rb").read()}


async def shoot(files, out, chromium="/usr/bin/chromium"):
    """Open the page with every request served from ``files`` (others blocked), zoom, screenshot."""
    from playwright.async_api import async_playwright

    blocked, errors = [], []
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--host-resolver-rules=MAP * ~NOTFOUND"])
        context = await browser.new_context(viewport=VIEWPORT, device_scale_factor=SCALE)

        async def route(r):
            name = r.request.url.split("/", 3)[3].split("?")[0] if r.request.url.startswith(
                "http://viewer.invalid/") else None
            if name in files:
                kind = "text/html" if name.endswith(".html") else "application/javascript" \
                    if name.endswith(".js") else "application/json"
                await r.fulfill(body=files[name], content_type=kind)
            else:
                blocked.append(r.request.url)
                await r.abort("blockedbyclient")

        await context.route("**/*", route)
        page = await context.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else print(m.text))
        await page.goto("http://viewer.invalid/viewer.html?trace=trace.json&from=gloo:all_reduce"
                        "&pid=0&before=7.5&after=1&labels=165&title=DDP,+2+gloo+ranks")
        try:
            await page.wait_for_function("document.title === 'loaded'", timeout=60_000)
        except Exception:
            sys.exit(f"the viewer did not load: {errors[:3]}")
        await page.wait_for_timeout(500)
        # the tracks only: from the time ruler down (the toolbar and the panels are left out)
        top = await page.evaluate("""() => {
            const tv = document.querySelector('tr-ui-timeline-track-view');
            return tv ? tv.getBoundingClientRect().top : 0; }""")
        await page.screenshot(path=out, clip={"x": 0, "y": top, "width": VIEWPORT["width"],
                                              "height": VIEWPORT["height"] - top})
        await browser.close()
    if blocked or errors:
        sys.exit(f"the viewer asked the network for {blocked[:3]} or failed: {errors[:3]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    from labs.profiling import practice
    from PIL import Image

    files = assets()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(TRACES, f"rank{r}.json.gz") for r in (0, 1)]
        merged = practice.merge_traces(paths, os.path.join(tmp, "trace.json"))
        files["trace.json"] = open(merged["path"], "rb").read()
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        asyncio.run(shoot(files, args.out))
    Image.open(args.out).save(args.out, dpi=(96 * SCALE, 96 * SCALE), optimize=True)
    print(args.out)


if __name__ == "__main__":
    main()
