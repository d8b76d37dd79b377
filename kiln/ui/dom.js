// Small DOM helpers: element building, errors shown as the API's message and hint, formatting.

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
    else if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "value") el.value = v;
    else if (k === "checked") el.checked = !!v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";
export function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) el.setAttribute(k, v);
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// An error box: the envelope's message, its hint below, the code and status small.
export function errorBox(err) {
  const bits = [];
  if (err.status) bits.push(`HTTP ${err.status}`);
  if (err.code) bits.push(err.code);
  if (err.param) bits.push(`param: ${err.param}`);
  return h("div", { class: "error", role: "alert" },
    h("div", { class: "error-message" }, err.message || String(err)),
    err.hint ? h("div", { class: "error-hint" }, err.hint) : null,
    bits.length ? h("div", { class: "error-meta" }, bits.join(" · ")) : null);
}

// Run an async action from a button: disable it while it runs, show any error in `out` (or a toast).
export async function act(button, out, fn) {
  if (button) button.disabled = true;
  if (out) clear(out);
  try {
    return await fn();
  } catch (err) {
    if (out) clear(out, errorBox(err)); else toast(err.message, "bad", err.hint);
    return undefined;
  } finally {
    if (button) button.disabled = false;
  }
}

export function toast(message, kind = "ok", hint = null) {
  let host = document.getElementById("toasts");
  if (!host) host = document.body.appendChild(h("div", { id: "toasts" }));
  const t = h("div", { class: `toast ${kind}`, role: "status" }, h("div", {}, message), hint ? h("div", { class: "error-hint" }, hint) : null);
  host.append(t);
  setTimeout(() => t.remove(), kind === "bad" ? 8000 : 3500);
}

export function field(label, control, help) {
  return h("label", { class: "field" }, h("span", { class: "field-label" }, label), control,
    help ? h("span", { class: "field-help" }, help) : null);
}

export function input(attrs) { return h("input", { type: "text", ...attrs }); }
export function select(options, attrs) {
  return h("select", attrs || {}, options.map((o) => {
    const [value, label] = Array.isArray(o) ? o : [o, o];
    return h("option", { value }, label);
  }));
}

export function card(title, ...body) {
  return h("section", { class: "card" }, title ? h("h2", {}, title) : null, ...body);
}

// A table; on a phone each row becomes a small card whose cells carry their column's name.
export function table(columns, rows, attrs) {
  const body = rows.length ? rows : [h("tr", {}, h("td", { colspan: columns.length, class: "muted" }, "none yet"))];
  if (rows.length) {
    for (const tr of rows) {
      [...tr.children].forEach((td, i) => { if (columns[i]) td.dataset.label = columns[i]; });
    }
  }
  const a = attrs || {};
  return h("div", { class: "table-wrap" }, h("table", { ...a, class: `data-table ${a.class || ""}` },
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", {}, c)))),
    h("tbody", {}, body)));
}

export function badge(text, kind) { return h("span", { class: `badge ${kind || ""}` }, text); }

export function stateBadge(state) {
  const kind = { completed: "good", running: "info", queued: "muted", failed: "bad", cancelled: "warn",
    ok: "good", degraded: "bad", promoted: "good", kept: "warn", regression: "bad", demoted: "bad",
    inconclusive: "warn", error: "bad", pending: "info" }[state] || "";
  return badge(state ?? "—", kind);
}

export function fmtNum(v, digits = 1) {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en-US");
  return Number(v).toFixed(digits);
}

export function fmtPct(v, digits = 1) {
  return v === null || v === undefined || Number.isNaN(v) ? "—" : `${(100 * v).toFixed(digits)}%`;
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function fmtDuration(sec) {
  if (sec === null || sec === undefined) return "—";
  if (sec < 60) return `${sec.toFixed(sec < 10 ? 1 : 0)} s`;
  const m = Math.floor(sec / 60), hr = Math.floor(m / 60);
  if (hr) return `${hr} h ${m % 60} min`;
  return `${m} min ${Math.round(sec % 60)} s`;
}

export function fmtTime(value) {
  if (value === null || value === undefined || value === "") return "—";
  const d = typeof value === "number" ? new Date(value * (value < 1e12 ? 1000 : 1)) : new Date(value);
  if (Number.isNaN(d.getTime())) return String(value);
  return d.toLocaleString(undefined, { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

export function shortHash(sha) {
  if (!sha) return "—";
  return String(sha).replace(/^sha256:/, "").slice(0, 12);
}

export function json(value) { return h("pre", { class: "json" }, JSON.stringify(value, null, 2)); }

export function details(summary, ...body) {
  return h("details", {}, h("summary", {}, summary), ...body);
}

// Read a file input as text or as a Blob for multipart.
export function readText(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsText(file);
  });
}

// Save a Blob to disk through a temporary link.
export function saveBlob(blob, filename) {
  const url = URL.createObjectURL(blob);
  const a = h("a", { href: url, download: filename });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// A training config form: {key: [label, default, input attrs]} -> {key: [label, <input>]} (ids prefix-label).
export function configFields(prefix, defaults) {
  const out = {};
  for (const [k, [label, value, attrs]] of Object.entries(defaults)) out[k] = [label, input({ id: `${prefix}-${label}`, value, ...attrs })];
  return out;
}

// The filled-in fields of a configFields form as a config object (numbers, except output_name).
export function readConfig(fields) {
  const config = {};
  for (const [k, [, el]] of Object.entries(fields)) {
    const v = el.value.trim();
    if (v !== "") config[k] = k === "output_name" ? v : Number(v);
  }
  return config;
}
