/* The book's memory-timeline viewer (tools/memory_timeline.py): a snapshot in the format of
   torch.cuda.memory._dump_snapshot, drawn as the live bytes after every allocation and free, one
   band per block stacked in allocation order (the blocks held at the start at the bottom), the
   peak marked; pointing at a band names its block. The replay is labs.measure.memory_snapshot's
   `replay`, line for line, so the peak printed here is the one the notebook asserts. */
(function () {
  "use strict";
  const SVGNS = "http://www.w3.org/2000/svg";
  const FREES = new Set(["free_completed", "free"]);

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0, v = n;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    const digits = Number.isInteger(v) ? 0 : v < 10 ? 2 : 1;
    return v.toFixed(digits) + " " + units[i];
  }

  // The replay: blocks with the x range they are live over (x = events applied so far).
  function replay(snapshot) {
    const events = snapshot.device_traces[0];
    const allocated = new Set(events.filter(e => e.action === "alloc").map(e => e.addr));
    const blocks = [], open = new Map();
    const name = e => (e.frames && e.frames.length ? e.frames[0].name : "?");
    let start = 0;
    for (const e of events) {   // freed without an allocation in the trace: held at the start
      if (FREES.has(e.action) && !allocated.has(e.addr)) {
        start += e.size;
        const b = {addr: e.addr, size: e.size, name: name(e), from: 0, to: null, held: true};
        blocks.push(b); open.set(e.addr, b);
      }
    }
    for (const seg of snapshot.segments) {
      for (const blk of seg.blocks) {
        if (seg.device === 0 && blk.state === "active_allocated" && !allocated.has(blk.address)) {
          start += blk.requested_size;
          blocks.push({addr: blk.address, size: blk.requested_size, name: name(blk), from: 0,
                       to: null, held: true});
        }
      }
    }
    const live = [start];
    let x = 0, now = start;
    for (const e of events) {
      if (e.action === "alloc") {
        now += e.size; x++;
        const b = {addr: e.addr, size: e.size, name: name(e), from: x, to: null, held: false};
        blocks.push(b); open.set(e.addr, b);
      } else if (FREES.has(e.action)) {
        now -= e.size; x++;
        const b = open.get(e.addr);
        if (b) { b.to = x; open.delete(e.addr); }
      } else {
        continue;
      }
      live.push(now);
    }
    for (const b of blocks) if (b.to === null) b.to = x + 1;   // still held at the end
    return {blocks, live, start};
  }

  // Each block's lower edge at every x it is live: the bytes of the live blocks under it.
  function stack(blocks, n) {
    const lows = blocks.map(() => []);
    for (let x = 0; x < n; x++) {
      let off = 0;
      blocks.forEach((b, i) => {
        if (b.from <= x && x < b.to) { lows[i].push(off); off += b.size; }
      });
    }
    return lows;
  }

  function colour(b) {
    if (b.held) return "hsl(220, 8%, 62%)";
    let h = 0;
    for (const c of b.name) h = (h * 31 + c.charCodeAt(0)) % 360;
    return `hsl(${h}, 60%, 58%)`;
  }

  function el(tag, attrs, parent) {
    const e = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (parent) parent.appendChild(e);
    return e;
  }

  function ticks(max) {
    let step = 1;
    while (max / step > 5) step *= 2;
    const out = [];
    for (let v = 0; v <= max; v += step) out.push(v);
    return out;
  }

  function draw(box, data, state) {
    const width = Math.max(300, box.clientWidth), narrow = width < 600;
    const height = narrow ? 240 : 300;
    const m = {left: narrow ? 62 : 74, right: 10, top: 12, bottom: 40};
    const n = data.live.length, peak = Math.max(...data.live), px = data.live.indexOf(peak);
    const X = x => m.left + (x / n) * (width - m.left - m.right);
    const Y = v => height - m.bottom - (v / (peak * 1.08)) * (height - m.top - m.bottom);
    const svg = el("svg", {viewBox: `0 0 ${width} ${height}`, width, height, role: "img",
                           "aria-label": `live bytes over ${n - 1} allocations and frees; peak ${bytes(peak)}`});
    data.blocks.forEach((b, i) => {
      const low = state.lows[i], top = [], bottom = [];
      for (let x = b.from, k = 0; x < Math.min(b.to, n); x++, k++) {
        top.push(`${X(x)},${Y(low[k] + b.size)}`, `${X(x + 1)},${Y(low[k] + b.size)}`);
        bottom.push(`${X(x + 1)},${Y(low[k])}`, `${X(x)},${Y(low[k])}`);
      }
      if (!top.length) return;
      const p = el("polygon", {points: top.concat(bottom.reverse()).join(" "), fill: colour(b),
                               stroke: "none"}, svg);
      p.dataset.block = i;
    });
    const axis = {stroke: "currentColor", "stroke-width": 1};
    el("line", {x1: m.left, y1: Y(0), x2: width - m.right, y2: Y(0), ...axis}, svg);
    el("line", {x1: m.left, y1: Y(0), x2: m.left, y2: m.top, ...axis}, svg);
    for (const v of ticks(peak)) {
      el("line", {x1: m.left - 4, y1: Y(v), x2: m.left, y2: Y(v), ...axis}, svg);
      const t = el("text", {x: m.left - 6, y: Y(v) + 4, "text-anchor": "end", class: "dtm-tick"}, svg);
      t.textContent = bytes(v);
    }
    el("line", {x1: m.left, y1: Y(peak), x2: width - m.right, y2: Y(peak), stroke: "currentColor",
                "stroke-dasharray": "5 4", "stroke-width": 1}, svg);
    const pl = el("text", {x: width - m.right - 2, y: Y(peak) - 5, "text-anchor": "end",
                           class: "dtm-tick"}, svg);
    pl.textContent = `peak ${bytes(peak)} after event ${px}`;
    const xl = el("text", {x: (m.left + width - m.right) / 2, y: height - 10, "text-anchor": "middle",
                           class: "dtm-tick"}, svg);
    xl.textContent = `allocations and frees, in order (${n - 1})`;
    const hit = el("rect", {x: m.left, y: m.top, width: width - m.left - m.right,
                            height: height - m.top - m.bottom, fill: "transparent"}, svg);
    const point = ev => {
      const r = svg.getBoundingClientRect();
      const x = Math.floor(((ev.clientX - r.left) * width / r.width - m.left) / (width - m.left - m.right) * n);
      const y = peak * 1.08 * (height - m.bottom - (ev.clientY - r.top) * height / r.height)
        / (height - m.top - m.bottom);
      if (x < 0 || x >= n) return;
      let found = null;
      data.blocks.forEach((b, i) => {
        if (b.from <= x && x < b.to) {
          const low = state.lows[i][x - b.from];
          if (low <= y && y < low + b.size) found = b;
        }
      });
      state.info.textContent = `after event ${x}: ${bytes(data.live[x])} live` + (found
        ? ` · pointing at ${bytes(found.size)} made by ${found.name}, ` +
          (found.held ? "held from the start" : `allocated at event ${found.from}`) +
          (found.to > n - 1 ? ", still held at the end" : `, freed at event ${found.to}`)
        : "");
    };
    hit.addEventListener("pointermove", point);
    hit.addEventListener("click", point);
    return {svg, peak, px};
  }

  function show(box) {
    const name = box.dataset.snapshot, snapshot = (window.dtmMemory || {})[name];
    if (!snapshot) {
      box.dataset.error = `no snapshot ${name}`;
      box.textContent = `The memory timeline's data (${name}) did not load.`;
      console.error(`memory timeline: no snapshot ${name}`);
      return;
    }
    const data = replay(snapshot);
    const state = {lows: stack(data.blocks, data.live.length)};
    const head = document.createElement("p");
    head.className = "dtm-memory-head";
    const plot = document.createElement("div");
    plot.className = "dtm-memory-plot";
    state.info = document.createElement("p");
    state.info.className = "dtm-memory-info";
    state.info.textContent = "Point at (or tap) a band to name its block.";
    box.replaceChildren(head, plot, state.info);
    let last = 0;
    const render = () => {
      if (plot.clientWidth === last) return;
      last = plot.clientWidth;
      const {svg, peak, px} = draw(plot, data, state);
      plot.replaceChildren(svg);
      const live = data.live;
      head.textContent = `${data.blocks.length} blocks, ${live.length - 1} allocations and frees ` +
        `(torch ${snapshot.torch}): ${bytes(data.start)} held at the start, peak ` +
        `${peak.toLocaleString("en")} bytes after event ${px}, ${bytes(live[live.length - 1])} at the end.`;
      box.dataset.peak = peak;
    };
    render();
    window.addEventListener("resize", render);
  }

  window.dtmMemoryReplay = replay;   // for tests/test_memory_timeline.py
  function main() { document.querySelectorAll(".dtm-memory").forEach(show); }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", main);
  else main();
})();
