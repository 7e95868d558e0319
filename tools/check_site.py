"""Open every page of the built site in headless Chromium, as a reader would, and fail on defects.

    python tools/check_site.py [_build/html] [--screenshots DIR]

The site is served on 127.0.0.1 (a free port), every request to another host is blocked (and
reported), and each page is checked once its math is typeset and its fonts and images loaded:

- raw pipe-table text (`|---|`): a Markdown table that did not render;
- raw TeX (`\\(`, `\\[`, `$$`, `\\begin{`, `\\frac`, ...) outside rendered math, formulas that
  MathJax did not typeset, and MathJax errors;
- unresolved `{glue` text and visible `NBVAL_` markers;
- console errors and uncaught exceptions;
- images that did not load (naturalWidth 0), local files that answer 404;
- links to a local page or anchor that does not exist;
- any request to a host other than 127.0.0.1 (the site must work with the network off);
- cell output blocks whose text is wider than the column (cut off at the right edge), and code
  blocks of the prose that are (notebook code cells that scroll sideways are listed as notes).

The browser is Debian's `chromium` (`apt-get install chromium`), driven by the playwright Python
package with `executable_path`: nothing downloads a browser. Without Chromium the check fails.
"""
import argparse
import asyncio
import functools
import http.server
import os
import re
import shutil
import sys
import threading
import time
from urllib.parse import unquote, urlsplit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_HINT = "install it with `apt-get install chromium` (as root) or pass --chromium PATH"

# Text that must never be visible on a page (code inputs and code blocks of the prose are
# excluded, cell outputs are not). Each pattern is named in the report.
TEXT_DEFECTS = [
    # the separator row; smartquotes turns its "---" into an em dash where the table did not render
    ("raw pipe table", re.compile(r"\|\s*:?(?:-{3,}|[\u2013\u2014]+-?):?\s*\|")),
    ("raw TeX", re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$|\\(?:begin|end)\{|\\(?:frac|tfrac|dfrac|cdot|times|sum|prod|sqrt|mathrm|mathbf|text|left|right|lceil|rceil|lfloor|rfloor|approx|le|ge|alpha|beta)(?![A-Za-z])")),
    ("unresolved glue", re.compile(r"\{glue")),
    ("nbval marker", re.compile(r"NBVAL_[A-Z_]+")),
]

# Runs in the page once it has loaded: waits for MathJax, fonts and images, then collects what
# the checks need. Prose code (not cell outputs) is dropped before the text checks.
PAGE_SCRIPT = """
async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  const imgs = Array.from(document.images);
  await Promise.all(imgs.map(img => {
    img.loading = 'eager';
    if (img.complete) return null;
    return new Promise(done => { img.onload = img.onerror = done; setTimeout(done, 10000); });
  }));
  await document.fonts.ready;
  const clone = document.body.cloneNode(true);
  clone.querySelectorAll('script, style, template, textarea, mjx-container, .cell_input').forEach(e => e.remove());
  clone.querySelectorAll('pre, code').forEach(e => { if (!e.closest('.cell_output')) e.remove(); });
  const longest = pre => pre.textContent.split('\\n').reduce((a, b) => (b.length > a.length ? b : a), '');
  const wide = Array.from(document.querySelectorAll('pre'))
    .filter(pre => pre.getClientRects().length && pre.scrollWidth > pre.clientWidth + 1);
  const overflow = wide.filter(pre => pre.closest('.cell_output')).map(longest);
  const wideCode = wide.filter(pre => !pre.closest('.cell_output') && !pre.closest('.cell_input')).map(longest);
  const wideInputs = wide.filter(pre => pre.closest('.cell_input')).map(longest);
  const wideTables = Array.from(document.querySelectorAll('div.cell_output table'))
    .filter(t => t.parentElement.scrollWidth > t.parentElement.clientWidth + 1)
    .map(t => (t.querySelector('tr') || t).textContent.trim().replace(/\\s+/g, ' ').slice(0, 60));
  return {
    text: clone.textContent,
    wideTables: wideTables,
    mathErrors: Array.from(document.querySelectorAll('mjx-merror'), e => e.getAttribute('data-mjx-error') || e.textContent),
    untypeset: Array.from(document.querySelectorAll('span.math, div.math'))
      .filter(e => !e.querySelector('mjx-container')).map(e => e.textContent.trim().slice(0, 80)),
    brokenImages: imgs.filter(img => img.naturalWidth === 0).map(img => img.getAttribute('src')),
    links: Array.from(document.querySelectorAll('a[href]'), a => a.href),
    ids: Array.from(document.querySelectorAll('[id]'), e => e.id)
      .concat(Array.from(document.querySelectorAll('a[name]'), e => e.name)),
    overflow: overflow,
    wideCode: wideCode,
    wideInputs: wideInputs,
    inputs: Array.from(document.querySelectorAll('.cell_input'), e => e.textContent),
  };
}
"""


def find_chromium(explicit):
    candidates = [explicit] if explicit else [
        os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
        shutil.which("chromium-browser"), shutil.which("google-chrome")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def html_pages(site):
    """Every HTML page of the site (not theme templates under _static, nor _sources)."""
    pages = []
    for dirpath, dirnames, filenames in os.walk(site):
        rel = os.path.relpath(dirpath, site)
        if rel.split(os.sep)[0] in ("_static", "_sources", "_images"):
            dirnames[:] = []
            continue
        pages += [os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/")
                  for f in filenames if f.endswith(".html")]
    return sorted(pages)


def serve(site):
    """An HTTP server for `site` on 127.0.0.1 and a free port, in a daemon thread."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], ConnectionError):  # a tab closed mid-transfer
                super().handle_error(request, client_address)
    handler = functools.partial(Quiet, directory=site)
    server = Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Site:
    """What the pages reported, and the defects found."""

    def __init__(self, site, base):
        self.site, self.base = site, base
        self.defects = []          # (page, defect)
        self.ids = {}              # page path -> set of element ids seen in the browser
        self.links = []            # (page, absolute href)
        self.notes = []            # (page, note): shown, never a failure
        self.shot_lock = asyncio.Lock()

    def add(self, page, defect):
        if (page, defect) not in self.defects:
            self.defects.append((page, defect))

    def local_path(self, url):
        """The site path of a URL on our server, or None if it is on another host."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.netloc != urlsplit(self.base).netloc:
            return None
        path = unquote(parts.path).lstrip("/")
        if path == "" or path.endswith("/"):
            path += "index.html"
        return path

    def check_links(self):
        for page, href in self.links:
            target = self.local_path(href)
            if target is None:
                continue  # mailto:, javascript:, another host: a reader's click, not a request
            file = os.path.join(self.site, target)
            if not os.path.isfile(file):
                self.add(page, f"broken link: {href.replace(self.base, '')} (no such file)")
                continue
            fragment = unquote(urlsplit(href).fragment)
            if not fragment or not target.endswith(".html"):
                continue
            ids = self.ids.get(target)
            if ids is None:  # a page not opened (cannot happen for pages of the site): parse it
                with open(file, encoding="utf-8", errors="replace") as f:
                    ids = set(re.findall(r'\b(?:id|name)="([^"]+)"', f.read()))
            if fragment not in ids:
                self.add(page, f"broken link: {href.replace(self.base, '')} (no such anchor)")


async def check_page(context, site, page, shots, timeout_s):
    tab = await context.new_page()
    base = site.base

    def on_console(msg):
        if msg.type != "error":
            return
        where = (msg.location or {}).get("url", "")
        if site.local_path(where) is None and where:
            return  # the failed load of a blocked request: reported as such below
        site.add(page, f"console error: {msg.text[:200]}")

    def on_response(resp):
        if resp.status >= 400 and site.local_path(resp.url) is not None:
            site.add(page, f"missing file: {resp.url.replace(base, '')} (HTTP {resp.status})")

    tab.on("console", on_console)
    tab.on("pageerror", lambda err: site.add(page, f"uncaught exception: {str(err)[:200]}"))
    tab.on("response", on_response)
    try:
        await tab.goto(base + page, wait_until="load", timeout=timeout_s * 1000)
        with open(os.path.join(site.site, page), encoding="utf-8", errors="replace") as f:
            head = f.read(2000)
        if re.search(r'http-equiv="Refresh"', head, re.I):  # a redirect page: its target is a link
            m = re.search(r'url=([^"\']+)', head)
            site.links.append((page, base + os.path.dirname(page) + ("/" if os.path.dirname(page) else "") + m.group(1).strip()))
            return
        info = await asyncio.wait_for(tab.evaluate(PAGE_SCRIPT), timeout_s)
    except Exception as e:  # a page that cannot be opened or never settles is a defect
        site.add(page, f"page did not load: {str(e).splitlines()[0][:200]}")
        return
    finally:
        if shots and not tab.is_closed():
            name = page.replace("/", "__").removesuffix(".html") + ".png"
            try:
                async with site.shot_lock:  # one at a time, in front: background tabs tile badly
                    await tab.bring_to_front()
                    await tab.screenshot(path=os.path.join(shots, name), full_page=True)
            except Exception as e:
                print(f"note: no screenshot of {page}: {e}", file=sys.stderr)
        await tab.close()
    for name, pattern in TEXT_DEFECTS:
        found = list(pattern.finditer(info["text"]))
        if found:
            m, text = found[0], info["text"]
            snippet = " ".join(text[max(0, m.start() - 40): m.end() + 40].split())
            where = f"{len(found)} places, the first" if len(found) > 1 else "in"
            site.add(page, f"{name} ({where}: ...{snippet}...)")
    for text in info["inputs"]:  # code cells: only markers meant for nbval, never for a reader
        for m in TEXT_DEFECTS[-1][1].finditer(text):
            site.add(page, f"nbval marker in a code cell: {m.group(0)} (use a cell tag)")
    if info["untypeset"]:
        site.add(page, f"formulas not typeset: {len(info['untypeset'])}, the first: {info['untypeset'][0]}")
    for err in info["mathErrors"]:
        site.add(page, f"MathJax error: {err[:200]}")
    for src in info["brokenImages"]:
        site.add(page, f"broken image: {src}")
    for line in info["overflow"]:
        site.add(page, f"output cut off at the right edge: {line.strip()[:100]}")
    for line in info["wideCode"]:
        site.add(page, f"code block wider than the column (scrolls sideways): {line.strip()[:100]}")
    for head in info["wideTables"]:  # it scrolls inside the column: readable, a note
        site.notes.append((page, f"an output table scrolls sideways: {head}..."))
    if info["wideInputs"]:  # notebook code scrolls like code in any editor: a note, not a defect
        longest = max(info["wideInputs"], key=len).strip()
        site.notes.append((page, f"{len(info['wideInputs'])} code cells scroll sideways; the longest line "
                                 f"has {len(longest)} characters: {longest[:60]}..."))
    site.ids[page] = set(info["ids"])
    site.links += [(page, href) for href in info["links"]]


async def run(site_dir, chromium, shots, jobs, timeout_s):
    from playwright.async_api import async_playwright

    server = serve(site_dir)
    site = Site(site_dir, f"http://127.0.0.1:{server.server_address[1]}/")
    pages = html_pages(site_dir)
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(
                executable_path=chromium,
                # No sandbox: CI runs as root. No name resolves: nothing reaches the network.
                args=["--no-sandbox", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
            context = await browser.new_context(viewport={"width": 1280, "height": 900})

            async def route(r):
                if site.local_path(r.request.url) is None and not r.request.url.startswith(("data:", "blob:")):
                    site.add(_page_of(r.request), f"request to another host (blocked): {r.request.url[:200]}")
                    await r.abort("blockedbyclient")
                else:
                    await r.continue_()

            def _page_of(request):
                frame_url = request.frame.url if request.frame else ""
                return site.local_path(frame_url) or frame_url or "?"

            await context.route("**/*", route)
            limit = asyncio.Semaphore(jobs)

            async def one(page):
                async with limit:
                    await check_page(context, site, page, shots, timeout_s)

            await asyncio.gather(*(one(page) for page in pages))
            await browser.close()
    finally:
        server.shutdown()
    site.check_links()
    return pages, site.defects, site.notes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("site", nargs="?", default=os.path.join(ROOT, "_build", "html"), help="the built site (default: _build/html)")
    ap.add_argument("--chromium", help="the browser (default: $CHROMIUM, /usr/bin/chromium, chromium on PATH)")
    ap.add_argument("--screenshots", metavar="DIR", help="save a full-page screenshot of every page into DIR")
    ap.add_argument("--jobs", type=int, default=4, help="pages open at once (default 4)")
    ap.add_argument("--timeout", type=int, default=60, help="seconds a page may take to load and settle")
    args = ap.parse_args(argv)

    if not os.path.isfile(os.path.join(args.site, "index.html")) and not html_pages(args.site):
        sys.exit(f"error: no built site in {args.site}; build it first (python tools/build_book.py --no-execute)")
    chromium = find_chromium(args.chromium)
    if chromium is None:
        sys.exit(f"error: the browser check needs Chromium, which is not installed here; {INSTALL_HINT}.")
    try:
        import playwright  # noqa: F401
    except ImportError:
        sys.exit("error: the browser check needs the playwright package; pip install -r requirements.txt")
    if args.screenshots:
        os.makedirs(args.screenshots, exist_ok=True)

    start = time.monotonic()
    try:
        pages, defects, notes = asyncio.run(run(os.path.abspath(args.site), chromium, args.screenshots, args.jobs, args.timeout))
    except Exception as e:
        sys.exit(f"error: could not run Chromium ({chromium}): {str(e).splitlines()[0]}; {INSTALL_HINT}.")
    took = time.monotonic() - start
    for page, note in sorted(notes):
        print(f"{page}: note: {note}")
    for page, defect in sorted(defects):
        print(f"{page}: {defect}")
    broken = len({page for page, _ in defects})
    print(f"browser check: {len(pages)} pages in {took:.0f} s, "
          + (f"{len(defects)} defects on {broken} pages" if defects else "no defects"))
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
