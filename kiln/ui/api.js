// The one way the page talks to the server: JSON calls, SSE streams, the API key, feature detection.
// Every failure becomes an ApiError carrying the server's envelope ({message, type, param, code, hint}).

const KEY_STORAGE = "kiln.apiKey";

export class ApiError extends Error {
  constructor(status, envelope) {
    const e = envelope || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || null;
    this.type = e.type || null;
    this.param = e.param || null;
    this.hint = e.hint || null;
  }
}

export function apiKey() {
  try { return localStorage.getItem(KEY_STORAGE) || ""; } catch { return ""; }
}

export function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key); else localStorage.removeItem(KEY_STORAGE);
  } catch { /* private mode: the key lives for this page only */ }
  memoryKey = key || "";
}

let memoryKey = "";
// Called when the server answers 401 invalid_api_key; app.js asks the person for the key and resolves
// with true when a new one was entered (the call is then retried once).
let onUnauthorized = async () => false;
export function setUnauthorizedHandler(fn) { onUnauthorized = fn; }

function headers(extra) {
  const h = { ...(extra || {}) };
  const key = apiKey() || memoryKey;
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

async function envelopeOf(resp) {
  const text = await resp.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error) return body.error;
    if (body && body.detail) return { message: typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail) };
  } catch { /* not JSON */ }
  return { message: `HTTP ${resp.status} ${resp.statusText}${text ? ": " + text.slice(0, 200) : ""}` };
}

async function send(method, path, { body, form, raw, signal } = {}) {
  const init = { method, signal, headers: headers() };
  if (form) init.body = form;
  else if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, { message: `Cannot reach the server (${err.message})`, hint: "Is kiln serve still running?" });
  }
  return resp;
}

// One call; retried once after the person enters an API key.
export async function request(method, path, opts = {}) {
  let resp = await send(method, path, opts);
  if (resp.status === 401) {
    const env = await envelopeOf(resp.clone());
    if (env.code === "invalid_api_key" && (await onUnauthorized(env))) resp = await send(method, path, opts);
  }
  if (!resp.ok) throw new ApiError(resp.status, await envelopeOf(resp));
  if (opts.raw) return resp;
  const type = resp.headers.get("content-type") || "";
  return type.includes("json") ? resp.json() : resp.text();
}

export const get = (path, opts) => request("GET", path, opts);
export const post = (path, body, opts) => request("POST", path, { ...opts, body });
export const del = (path, opts) => request("DELETE", path, opts);
export const put = (path, body, opts) => request("PUT", path, { ...opts, body });

// Whether an optional route exists on this server (routes other work adds later). A 404 whose body is
// not a Kiln envelope with a resource code means the route is missing; anything else means it exists.
const known = new Map();
export async function hasRoute(path) {
  if (known.has(path)) return known.get(path);
  let exists = true;
  try {
    await request("GET", path);
  } catch (err) {
    // FastAPI answers an unknown route with code not_found; 405 means the route exists for POST only
    exists = !(err.status === 404 && (err.code === "not_found" || !err.code)) && err.status !== 0;
  }
  known.set(path, exists);
  return exists;
}

// POST a chat request with stream: true and call onChunk(json) for every SSE data event.
export async function streamChat(body, onChunk, signal) {
  let resp = await send("POST", "/v1/chat/completions", { body: { ...body, stream: true }, signal });
  if (resp.status === 401) {
    const env = await envelopeOf(resp.clone());
    if (env.code === "invalid_api_key" && (await onUnauthorized(env))) {
      resp = await send("POST", "/v1/chat/completions", { body: { ...body, stream: true }, signal });
    }
  }
  if (!resp.ok) throw new ApiError(resp.status, await envelopeOf(resp));
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      let parsed;
      try { parsed = JSON.parse(data); } catch { continue; }
      if (parsed.error) throw new ApiError(500, parsed.error);
      onChunk(parsed);
    }
  }
}

// Prometheus text exposition -> {name: [{labels, value}]}.
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    if (m[2]) for (const kv of m[2].slice(1, -1).matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[kv[1]] = kv[2];
    (out[m[1]] ||= []).push({ labels, value: Number(m[3]) });
  }
  return out;
}

export function metric(metrics, name, labels) {
  const rows = metrics[name] || [];
  const row = rows.find((r) => !labels || Object.entries(labels).every(([k, v]) => r.labels[k] === v));
  return row ? row.value : null;
}

export const q = encodeURIComponent;
