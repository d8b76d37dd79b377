// SVG charts drawn by hand: a line chart (loss curves, throughput), bars with Wilson intervals,
// and horizontal count bars (histograms). Each returns an <svg> that scales with its container.

import { s } from "./dom.js";

const PALETTE = ["#2f6fde", "#e0662d", "#1f9d55", "#9b4dca", "#c23b6b", "#0f9bb0", "#b08900", "#5c6b7a"];
export const color = (i) => PALETTE[i % PALETTE.length];

// Charts are drawn at the width they are shown at, so their text stays at its size on a phone.
export function fitWidth(max = 1100) {
  const page = document.getElementById("page");
  return Math.max(300, Math.min(max, (page ? page.clientWidth : 700) - 64));
}

function niceTicks(min, max, count = 4) {
  if (!(max > min)) { max = min + 1; }
  const span = max - min;
  const step0 = span / count;
  const mag = 10 ** Math.floor(Math.log10(step0));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((st) => span / st <= count) || 10 * mag;
  const ticks = [];
  const last = Math.ceil(max / step - 1e-9) * step;
  for (let v = Math.floor(min / step + 1e-9) * step; v <= last + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
  return ticks;
}

function fmtTick(v) {
  const a = Math.abs(v);
  if (a >= 1000) return `${+(v / 1000).toFixed(1)}k`;
  if (a >= 10 || v === 0) return `${+v.toFixed(0)}`;
  if (a >= 1) return `${+v.toFixed(1)}`;
  return `${+v.toPrecision(2)}`;
}

// series: [{name, points: [[x, y], ...]}]
export function lineChart(series, { width = fitWidth(), height = 220, xLabel = "", yLabel = "", yMin = null, yMaxAtLeast = null, id = null } = {}) {
  const pad = { l: 48, r: 12, t: 12, b: 34 };
  const all = series.flatMap((sr) => sr.points).filter(([x, y]) => Number.isFinite(x) && Number.isFinite(y));
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img", id,
    "aria-label": `${yLabel || "value"} by ${xLabel || "x"}`, "data-points": all.length });
  if (!all.length) {
    svg.append(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "chart-empty" }, "no points yet"));
    return svg;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (yMin !== null) y0 = Math.min(y0, yMin);
  // an idle series (all zeros) keeps a readable axis instead of ticks at 0.025
  if (yMaxAtLeast !== null) y1 = Math.max(y1, yMaxAtLeast);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 = y0 + Math.abs(y0 || 1) * 0.1; y0 = yMin !== null ? y0 : y0 - Math.abs(y0 || 1) * 0.1; }
  const yt = niceTicks(y0, y1), xt = niceTicks(x0, x1, 5);
  y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]);
  const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * (width - pad.l - pad.r);
  const Y = (y) => height - pad.b - ((y - y0) / (y1 - y0)) * (height - pad.t - pad.b);
  for (const t of yt) {
    svg.append(s("line", { x1: pad.l, x2: width - pad.r, y1: Y(t), y2: Y(t), class: "grid" }));
    svg.append(s("text", { x: pad.l - 6, y: Y(t) + 4, "text-anchor": "end", class: "tick" }, fmtTick(t)));
  }
  for (const t of xt) {
    if (t < x0 || t > x1) continue;
    svg.append(s("text", { x: X(t), y: height - pad.b + 16, "text-anchor": "middle", class: "tick" }, fmtTick(t)));
  }
  svg.append(s("line", { x1: pad.l, x2: width - pad.r, y1: height - pad.b, y2: height - pad.b, class: "axis" }));
  if (xLabel) svg.append(s("text", { x: (pad.l + width - pad.r) / 2, y: height - 4, "text-anchor": "middle", class: "label" }, xLabel));
  if (yLabel) svg.append(s("text", { x: 12, y: pad.t + (height - pad.t - pad.b) / 2, "text-anchor": "middle", class: "label",
    transform: `rotate(-90 12 ${pad.t + (height - pad.t - pad.b) / 2})` }, yLabel));
  series.forEach((sr, i) => {
    const pts = sr.points.filter(([x, y]) => Number.isFinite(x) && Number.isFinite(y));
    if (!pts.length) return;
    const d = pts.map(([x, y], j) => `${j ? "L" : "M"}${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join("");
    svg.append(s("path", { d, class: "series", stroke: sr.color || color(i), "data-series": sr.name || i }));
    if (pts.length <= 60) {
      for (const [x, y] of pts) svg.append(s("circle", { cx: X(x), cy: Y(y), r: 2.5, fill: sr.color || color(i), class: "point" },
        s("title", {}, `${xLabel || "x"} ${fmtTick(x)}: ${y.toPrecision(4)}`)));
    }
  });
  if (series.length > 1) {
    series.forEach((sr, i) => {
      const x = pad.l + 8 + i * 130, y = pad.t + 6;
      svg.append(s("rect", { x, y, width: 10, height: 10, fill: sr.color || color(i) }));
      svg.append(s("text", { x: x + 14, y: y + 9, class: "tick" }, sr.name));
    });
  }
  return svg;
}

export function sparkline(values, { width = 160, height = 36 } = {}) {
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "spark", preserveAspectRatio: "none" });
  const v = values.filter(Number.isFinite);
  if (v.length < 2) return svg;
  const max = Math.max(...v, 1e-9), min = 0;
  const X = (i) => (i / (v.length - 1)) * width;
  const Y = (y) => height - 2 - ((y - min) / (max - min)) * (height - 4);
  const d = v.map((y, i) => `${i ? "L" : "M"}${X(i).toFixed(1)},${Y(y).toFixed(1)}`).join("");
  svg.append(s("path", { d: `${d}L${width},${height}L0,${height}Z`, class: "spark-fill" }));
  svg.append(s("path", { d, class: "spark-line" }));
  return svg;
}

// bars: [{label, value (0..1), lower, upper, n}] drawn as rate bars with Wilson interval whiskers.
export function rateBars(bars, { width = fitWidth(900), rowHeight = 30, id = null, title = "" } = {}) {
  const pad = { l: Math.min(220, width * 0.34, 40 + 7 * Math.max(4, ...bars.map((b) => String(b.label).length))), r: width < 500 ? 70 : 84, t: 8, b: 28 };
  const height = pad.t + pad.b + rowHeight * Math.max(1, bars.length);
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img", id, "aria-label": title || "rates" });
  const X = (v) => pad.l + v * (width - pad.l - pad.r);
  for (const t of [0, 0.25, 0.5, 0.75, 1]) {
    svg.append(s("line", { x1: X(t), x2: X(t), y1: pad.t, y2: height - pad.b, class: "grid" }));
    svg.append(s("text", { x: X(t), y: height - pad.b + 16, "text-anchor": "middle", class: "tick" }, `${t * 100}%`));
  }
  bars.forEach((b, i) => {
    const y = pad.t + i * rowHeight, mid = y + rowHeight / 2;
    svg.append(s("text", { x: pad.l - 8, y: mid + 4, "text-anchor": "end", class: "tick" }, b.label));
    svg.append(s("rect", { x: X(0), y: y + 6, width: Math.max(0, X(b.value) - X(0)), height: rowHeight - 12,
      fill: b.color || color(i), opacity: 0.8, rx: 2 }, s("title", {}, `${b.label}: ${(100 * b.value).toFixed(1)}%`)));
    if (Number.isFinite(b.lower) && Number.isFinite(b.upper)) {
      svg.append(s("line", { x1: X(b.lower), x2: X(b.upper), y1: mid, y2: mid, class: "whisker" }));
      svg.append(s("line", { x1: X(b.lower), x2: X(b.lower), y1: mid - 6, y2: mid + 6, class: "whisker" }));
      svg.append(s("line", { x1: X(b.upper), x2: X(b.upper), y1: mid - 6, y2: mid + 6, class: "whisker" }));
    }
    svg.append(s("text", { x: width - pad.r + 6, y: mid + 4, class: "tick" }, `${(100 * b.value).toFixed(0)}%${b.n !== undefined ? ` n=${b.n}` : ""}`));
  });
  return svg;
}

// items: [{label, value}] as horizontal bars scaled to the largest value.
export function countBars(items, { width = Math.min(420, fitWidth()), rowHeight = 24, id = null } = {}) {
  const pad = { l: 70, r: 44, t: 4, b: 4 };
  const height = pad.t + pad.b + rowHeight * Math.max(1, items.length);
  const max = Math.max(1, ...items.map((i) => i.value));
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img", id });
  items.forEach((it, i) => {
    const y = pad.t + i * rowHeight;
    svg.append(s("text", { x: pad.l - 8, y: y + rowHeight / 2 + 4, "text-anchor": "end", class: "tick" }, it.label));
    svg.append(s("rect", { x: pad.l, y: y + 4, width: ((width - pad.l - pad.r) * it.value) / max, height: rowHeight - 8,
      fill: it.color || color(i), rx: 2 }));
    svg.append(s("text", { x: pad.l + ((width - pad.l - pad.r) * it.value) / max + 6, y: y + rowHeight / 2 + 4, class: "tick" }, it.value));
  });
  return svg;
}

// A stacked bar of partition sizes (train / validation / holdout).
export function stackBar(parts, { width = 300, height = 14 } = {}) {
  const total = parts.reduce((a, p) => a + p.value, 0) || 1;
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "stack", preserveAspectRatio: "none" });
  let x = 0;
  parts.forEach((p, i) => {
    const w = (width * p.value) / total;
    svg.append(s("rect", { x, y: 0, width: w, height, fill: p.color || color(i) }, s("title", {}, `${p.label}: ${p.value}`)));
    x += w;
  });
  return svg;
}
