// The ES-module face of d3 v5's UMD build for PyTorch's MemoryViz.js, offline (tools/memory_viewer.py).
// MemoryViz.js imports d3@5, d3-axis@1, d3-scale@1, d3-zoom@1 and d3-brush@1 from cdn.skypack.dev;
// the page's import map sends all five URLs here. d3 v5's one-file build (npm's d3@5.16.0,
// dist/d3.min.js) is loaded before by a classic <script>, as window.d3: one d3, so the zoom and the
// brush set the same `d3.event` that MemoryViz.js reads in their listeners.
// d3 v5 keeps the current event in `d3.event`, a property it reassigns around every listener call; a
// module cannot re-export a property as a live binding, so `event` here is a proxy that reads
// window.d3.event at each access (`d3.event.transform`, `.selection`, `.target`, `.key`,
// `.preventDefault()`: what MemoryViz.js uses).
const d3 = window.d3;
if (!d3 || !String(d3.version).startsWith('5.')) {
  throw new Error('d3-shim.js: d3 v5 (d3.min.js) must load before MemoryViz.js');
}
export const event = new Proxy({}, {
  get(_target, key) {
    const e = d3.event;
    if (e === null || e === undefined) return undefined;
    const value = e[key];
    return typeof value === 'function' ? value.bind(e) : value;
  },
});
export const {select, selectAll, format, axisLeft, scaleLinear, zoom, zoomIdentity, brushX} = d3;
