"""Open every page of the built site in headless Chromium, as a reader would, and fail on defects.

    python tools/check_site.py [_build/html] [--screenshots DIR] [--pages 05 ...]

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
  blocks of the prose that are;
- at 1280 x 900, display equations wider than their column (MathJax's box scrolls or is clipped);
- at a phone's 390 x 844 (the same tab, resized after the checks above): a page wider than the
  viewport, which scrolls sideways (the widest element that sticks out is named).

Then each page with a calculator (`<div class="dtm-calculator">`, tools/calculators.py) is opened
again at 1280 and at 390 px, each in a fresh context, and its calculators are checked against
CPython (tools/check_calculators.py): the cold time from navigation to the first answer (printed;
a defect above 60 s), the same numbers and summary as `forms.text(forms.answer(...))` for values
off the defaults, CPython's error sentence for a bad input, nothing wider than the box or the page.
The bytes the calculators add to the site are printed at the end.

Two checks are notes unless asked for with --enforce (the count is printed either way); `make test`
enforces both, so a notebook that breaks them fails the tests:
- `--enforce code-cells`: notebook code cells wider than their column at 1280 px;
- `--enforce figures`: figures too small to read at 390 px. The rule: matplotlib draws its labels
  and ticks at 10 pt, 10/72 inch, which is 10/72 x dpi pixels of the image (dpi from the PNG's
  pHYs chunk; 96 when it has none, the CSS pixel's own, as for SVG); scaled to its rendered
  width at 390 px, that text must stay at least MIN_FIGURE_TEXT_PX (7) CSS pixels high. A
  6.4-inch figure (matplotlib's default width) passes in a phone's column; a strip of five panels
  does not. Dropdowns are opened before anything is measured.

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_calculators  # noqa: E402  (beside this file)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_HINT = "install it with `apt-get install chromium` (as root) or pass --chromium PATH"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
FIGURE_TEXT_PT = 10        # matplotlib's default size for tick and axis labels
MIN_FIGURE_TEXT_PX = 7     # that text's least height at 390 px, in CSS pixels
DEFERRABLE = ("code-cells", "figures")

# Text that must never be visible on a page (code inputs and code blocks of the prose are
# excluded, cell outputs are not). Each pattern is named in the report.
TEXT_DEFECTS = [
    # the separator row; smartquotes turns its "---" into an em dash where the table did not render
    ("raw pipe table", re.compile(r"\|\s*:?(?:-{3,}|[\u2013\u2014]+-?):?\s*\|")),
    ("raw TeX",
     re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$|\\(?:begin|end)\{|\\(?:frac|tfrac|dfrac|cdot|times|sum|prod|sqrt|mathrm|mathbf|text|left|right|lceil|rceil|lfloor|rfloor|approx|le|ge|alpha|beta)(?![A-Za-z])")),
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
  document.querySelectorAll('details').forEach(d => { d.open = true; });  // measure what a dropdown holds
  await new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
  const clone = document.body.cloneNode(true);
  clone.querySelectorAll('script, style, template, textarea, mjx-container, .cell_input')
    .forEach(e => e.remove());
  clone.querySelectorAll('pre, code').forEach(e => { if (!e.closest('.cell_output')) e.remove(); });
  const longest = pre => pre.textContent.split('\\n').reduce((a, b) => (b.length > a.length ? b : a), '');
  const wide = Array.from(document.querySelectorAll('pre'))
    .filter(pre => pre.getClientRects().length && pre.scrollWidth > pre.clientWidth + 1);
  const overflow = wide.filter(pre => pre.closest('.cell_output')).map(longest);
  const wideCode = wide.filter(pre => !pre.closest('.cell_output') && !pre.closest('.cell_input'))
    .map(longest);
  const wideInputs = wide.filter(pre => pre.closest('.cell_input'))
    .map(pre => ({line: longest(pre), width: pre.scrollWidth, column: pre.clientWidth}));
  const texOf = new Map();
  if (window.MathJax && MathJax.startup && MathJax.startup.document)
    for (const item of MathJax.startup.document.math) texOf.set(item.typesetRoot, item.math);
  const wideMath = Array.from(new Set(
      document.querySelectorAll('div.math mjx-container, mjx-container[display="true"]')))
    .filter(c => c.getClientRects().length && c.scrollWidth > c.clientWidth + 1)
    .map(c => ({tex: (texOf.get(c) || c.textContent).trim().replace(/\\s+/g, ' ').slice(0, 80),
                width: c.scrollWidth, column: c.clientWidth}));
  const wideTables = Array.from(document.querySelectorAll('div.cell_output table'))
    .filter(t => t.parentElement.scrollWidth > t.parentElement.clientWidth + 1)
    .map(t => (t.querySelector('tr') || t).textContent.trim().replace(/\\s+/g, ' ').slice(0, 60));
  return {
    text: clone.textContent,
    wideTables: wideTables,
    mathErrors: Array.from(document.querySelectorAll('mjx-merror'),
                           e => e.getAttribute('data-mjx-error') || e.textContent),
    untypeset: Array.from(document.querySelectorAll('span.math, div.math'))
      .filter(e => !e.querySelector('mjx-container')).map(e => e.textContent.trim().slice(0, 80)),
    brokenImages: imgs.filter(img => img.naturalWidth === 0).map(img => img.getAttribute('src')),
    undrawn: Array.from(document.querySelectorAll('.dtm-memory'))
      .filter(e => !e.dataset.peak).map(e => e.dataset.snapshot),
    links: Array.from(document.querySelectorAll('a[href]'), a => a.href),
    ids: Array.from(document.querySelectorAll('[id]'), e => e.id)
      .concat(Array.from(document.querySelectorAll('a[name]'), e => e.name)),
    overflow: overflow,
    wideCode: wideCode,
    wideInputs: wideInputs,
    wideMath: wideMath,
    inputs: Array.from(document.querySelectorAll('.cell_input'), e => e.textContent),
  };
}
"""

# Runs after the tab is resized to a phone's width: does the page scroll sideways, and at what
# width does each figure render? An element inside a box that scrolls or clips is the box's
# business, not the page's, and a fixed one (the theme's drawers) never scrolls the page.
PHONE_SCRIPT = """
async () => {
  await new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
  const view = document.documentElement.clientWidth;
  const over = document.documentElement.scrollWidth - view;
  let culprit = null;
  if (over > 1) {
    const inBox = e => {  // clipped or scrolled by a box, or fixed (a drawer off screen): no page scroll
      if (getComputedStyle(e).position === 'fixed') return true;
      for (let a = e.parentElement; a && a !== document.body; a = a.parentElement) {
        const style = getComputedStyle(a);
        if (style.overflowX !== 'visible' || style.position === 'fixed') return true;
      }
      return false;
    };
    let best = null;
    for (const e of document.body.querySelectorAll('*')) {
      const r = e.getBoundingClientRect();
      const own = getComputedStyle(e).overflowX === 'visible' ? e.scrollWidth : 0;
      const right = Math.max(r.right, r.left + own);  // a word that sticks out of its block
      if (r.width === 0 || right <= view + 1 || inBox(e)) continue;
      if (!best || right > best.right + 0.5 || (right > best.right - 0.5 && best.e.contains(e)))
        best = {e: e, right: right};
    }
    if (best) {
      const cls = typeof best.e.className === 'string' && best.e.className
        ? '.' + best.e.className.split(' ')[0] : '';
      const text = best.e.textContent.trim().replace(/\\s+/g, ' ').slice(0, 70);
      culprit = `<${best.e.tagName.toLowerCase()}${cls}> ${text}`;
    }
  }
  const figures = Array.from(document.images).filter(img => img.getClientRects().length && img.naturalWidth)
    .map(img => ({src: img.getAttribute('src'), url: img.src, natural: img.naturalWidth,
                  width: img.getBoundingClientRect().width}));
  return {view: view, over: over, culprit: culprit, figures: figures};
}
"""


def image_dpi(path):
    """The dots per inch a PNG records (pHYs), else 96: the CSS pixel's, and an SVG's."""
    try:
        from PIL import Image
        with Image.open(path) as im:
            dpi = im.info.get("dpi")
        return float(dpi[0]) if dpi and dpi[0] > 0 else 96.0
    except Exception:  # not a raster image Pillow reads (an SVG): CSS pixels
        return 96.0


def figure_text_px(dpi, natural, width):
    """How high 10-point text of a figure stands on screen, in CSS pixels, at ``width``."""
    return FIGURE_TEXT_PT / 72 * dpi * width / natural


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

    def __init__(self, site, base, enforce=()):
        self.site, self.base, self.enforce = site, base, set(enforce)
        self.deferred = {name: [] for name in DEFERRABLE}   # what each deferrable check found
        self.defects = []          # (page, defect)
        self.ids = {}              # page path -> set of element ids seen in the browser
        self.links = []            # (page, absolute href)
        self.notes = []            # (page, note): shown, never a failure
        self.shot_lock = asyncio.Lock()
        self.dpis = {}
        self.calculators = []      # (page, {width: seconds to the first answer}): check_calculators

    def dpi(self, path):
        if path not in self.dpis:
            self.dpis[path] = image_dpi(path)
        return self.dpis[path]

    def add(self, page, defect):
        if (page, defect) not in self.defects:
            self.defects.append((page, defect))

    def defer(self, check, page, finding, count=1):
        """A finding of a deferrable check: a defect when --enforce names the check, else a note."""
        self.deferred[check].append((page, count))
        if check in self.enforce:
            self.add(page, finding)
        else:
            self.notes.append((page, f"{finding} (a note until --enforce {check})"))

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

    async def shoot(suffix):
        if not shots or tab.is_closed():
            return
        name = page.replace("/", "__").removesuffix(".html") + suffix + ".png"
        try:
            async with site.shot_lock:  # one at a time, in front: background tabs tile badly
                await tab.bring_to_front()
                await tab.screenshot(path=os.path.join(shots, name), full_page=True)
        except Exception as e:
            print(f"note: no screenshot of {page}: {e}", file=sys.stderr)

    tab.on("console", on_console)
    tab.on("pageerror", lambda err: site.add(page, f"uncaught exception: {str(err)[:200]}"))
    tab.on("response", on_response)
    info = None
    try:
        await tab.goto(base + page, wait_until="load", timeout=timeout_s * 1000)
        with open(os.path.join(site.site, page), encoding="utf-8", errors="replace") as f:
            head = f.read(2000)
        if re.search(r'http-equiv="Refresh"', head, re.I):  # a redirect page: its target is a link
            m = re.search(r'url=([^"\']+)', head)
            folder = os.path.dirname(page)
            site.links.append((page, base + folder + ("/" if folder else "") + m.group(1).strip()))
            return
        info = await asyncio.wait_for(tab.evaluate(PAGE_SCRIPT), timeout_s)
        await shoot("")
        await tab.set_viewport_size(PHONE)
        phone = await asyncio.wait_for(tab.evaluate(PHONE_SCRIPT), timeout_s)
        await shoot("@390")
    except Exception as e:  # a page that cannot be opened or never settles is a defect
        site.add(page, f"page did not load: {str(e).splitlines()[0][:200]}")
        if info is None:
            await shoot("")
        return
    finally:
        await tab.close()
    check_desktop(site, page, info)
    check_phone(site, page, phone)
    site.ids[page] = set(info["ids"])
    site.links += [(page, href) for href in info["links"]]


def check_desktop(site, page, info):
    """The defects of a page as the 1280-pixel tab saw it."""
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
    for name in info["undrawn"]:
        site.add(page, f"memory timeline not drawn: {name}")
    for line in info["overflow"]:
        site.add(page, f"output cut off at the right edge: {line.strip()[:100]}")
    for line in info["wideCode"]:
        site.add(page, f"code block wider than the column (scrolls sideways): {line.strip()[:100]}")
    for head in info["wideTables"]:  # it scrolls inside the column: readable, a note
        site.notes.append((page, f"an output table scrolls sideways: {head}..."))
    for eq in info["wideMath"]:
        site.add(page, f"display equation wider than the column at 1280 px ({eq['width']} px in "
                       f"{eq['column']} px; break it over lines): {eq['tex']}")
    if info["wideInputs"]:
        widest = max(info["wideInputs"], key=lambda c: c["width"])
        line = widest["line"].strip()
        site.defer("code-cells", page,
                   f"{len(info['wideInputs'])} code cells wider than the column at 1280 px; "
                   f"the widest, {widest['width']} px in {widest['column']} px, has a line of {len(line)} "
                   f"characters: {line[:60]}...", count=len(info["wideInputs"]))


def check_phone(site, page, phone):
    """The defects of a page resized to a phone's width: sideways scrolling, figures too small."""
    if phone["over"] > 1:
        site.add(page,
                 f"page wider than a {PHONE['width']} px viewport (scrolls sideways by {phone['over']} px); "
                       f"the widest part: {phone['culprit']}")
    for fig in phone["figures"]:
        path = site.local_path(fig["url"])
        dpi = site.dpi(os.path.join(site.site, path)) if path else 96.0
        px = figure_text_px(dpi, fig["natural"], fig["width"])
        if px < MIN_FIGURE_TEXT_PX:
            site.defer("figures", page,
                       f"figure too small to read at {PHONE['width']} px: its {FIGURE_TEXT_PT}-point "
                       f"text stands {px:.1f} px high (at least {MIN_FIGURE_TEXT_PX}); "
                       f"{fig['natural']} px at {dpi:g} dpi shown {fig['width']:.0f} px wide: {fig['src']}")


async def run(site_dir, chromium, shots, jobs, timeout_s, enforce=(), only=()):
    from playwright.async_api import async_playwright

    server = serve(site_dir)
    site = Site(site_dir, f"http://127.0.0.1:{server.server_address[1]}/", enforce)
    pages = [p for p in html_pages(site_dir) if not only or any(part in p for part in only)]
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(
                executable_path=chromium,
                # No sandbox: CI runs as root. No name resolves: nothing reaches the network.
                args=["--no-sandbox",
                      "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
            context = await browser.new_context(viewport=DESKTOP)

            async def route(r):
                url = r.request.url
                if site.local_path(url) is None and not url.startswith(("data:", "blob:")):
                    site.add(_page_of(r.request), f"request to another host (blocked): {url[:200]}")
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
            site.calculators = await check_calculators.check(
                browser, site, check_calculators.calculator_pages(site_dir, pages), route, (DESKTOP, PHONE),
                shots, timeout_s)
            await browser.close()
    finally:
        server.shutdown()
    site.check_links()
    return pages, site


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("site", nargs="?", default=os.path.join(ROOT, "_build", "html"),
                    help="the built site (default: _build/html)")
    ap.add_argument("--chromium",
                    help="the browser (default: $CHROMIUM, /usr/bin/chromium, chromium on PATH)")
    ap.add_argument("--screenshots", metavar="DIR", help="save a full-page screenshot of every page into DIR")
    ap.add_argument("--jobs", type=int, default=4, help="pages open at once (default 4)")
    ap.add_argument("--timeout", type=int, default=60, help="seconds a page may take to load and settle")
    ap.add_argument("--enforce", action="append", choices=DEFERRABLE, default=[],
                    help="make a check that is a note by default a failure: code-cells (notebook code wider "
                         "than its column at 1280 px), figures (text under 7 px high at 390 px); repeatable")
    ap.add_argument("--pages", nargs="+", metavar="PART", default=[],
                    help="check only the pages whose path contains one of these (e.g. --pages 05 intro)")
    args = ap.parse_args(argv)

    if not os.path.isfile(os.path.join(args.site, "index.html")) and not html_pages(args.site):
        sys.exit(f"error: no built site in {args.site}; build it first (python tools/build_book.py "
                 "--no-execute)")
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
        pages, site = asyncio.run(run(os.path.abspath(args.site), chromium, args.screenshots, args.jobs,
                                      args.timeout, args.enforce, args.pages))
    except Exception as e:
        sys.exit(f"error: could not run Chromium ({chromium}): {str(e).splitlines()[0]}; {INSTALL_HINT}.")
    took = time.monotonic() - start
    defects = site.defects
    for page, note in sorted(site.notes):
        print(f"{page}: note: {note}")
    for line in check_calculators.report(site.calculators, args.site):
        print(line)
    for page, defect in sorted(defects):
        print(f"{page}: {defect}")
    for check, what in (("code-cells", "notebook code cells wider than the column at 1280 px"),
                        ("figures", "figures too small to read at 390 px")):
        found = site.deferred[check]
        if found and check not in site.enforce:
            print(f"not enforced (--enforce {check}): {sum(n for _, n in found)} {what}, "
                  f"on {len({p for p, _ in found})} pages")
    broken = len({page for page, _ in defects})
    print(f"browser check: {len(pages)} pages at {DESKTOP['width']} and {PHONE['width']} px in {took:.0f} s, "
          + (f"{len(defects)} defects on {broken} pages" if defects else "no defects"))
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
