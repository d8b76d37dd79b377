// Overview: what is served and how it is doing. /health, /v1/config and /ui/api/info say what;
// live decode throughput and ITL come from /v1/stats/decode when the server has it, else from the
// deltas of /metrics counters between two scrapes.

import { get, hasRoute, metric, parseMetrics } from "./api.js";
import { lineChart } from "./charts.js";
import { badge, card, clear, errorBox, fmtDuration, fmtNum, fmtPct, fmtTime, h, shortHash, stateBadge, table } from "./dom.js";

const HISTORY = 90; // samples kept for the throughput chart

function tile(label, value, sub, id) {
  return h("div", { class: "tile", id }, h("div", { class: "tile-label" }, label),
    h("div", { class: "tile-value" }, value), sub ? h("div", { class: "tile-sub" }, sub) : null);
}

// The first numeric field whose name matches one of the patterns, as [dotted key, value] (the
// decode-stats route is new; read it by meaning rather than by one exact spelling).
function pick(obj, patterns) {
  if (!obj || typeof obj !== "object") return [null, null];
  const flat = {};
  const walk = (o, prefix) => {
    for (const [k, v] of Object.entries(o)) {
      if (v && typeof v === "object" && !Array.isArray(v)) walk(v, `${prefix}${k}.`);
      else if (typeof v === "number") flat[`${prefix}${k}`] = v;
    }
  };
  walk(obj, "");
  for (const p of patterns) {
    const key = Object.keys(flat).find((k) => p.test(k));
    if (key) return [key, flat[key]];
  }
  return [null, null];
}

function counter(m, name) {
  return metric(m, `${name}_total`) ?? metric(m, name);
}

const PUBLICATION_KIND = { current: "good", outdated: "warn", "push failed": "bad" };

// One row per (replica, adapter) it serves or failed to take: the revision it serves, and whether that
// is the revision stored here ("current"), an older one ("outdated"), or a newer one failed to arrive.
export function publicationRows(replicas, stored) {
  const here = Object.fromEntries(stored.map((a) => [a.name, a.content_sha256]));
  const rows = [];
  for (const r of replicas) {
    const failed = r.failed_pushes || {};
    const names = [...new Set([...Object.keys(r.published || {}), ...Object.keys(failed)])].sort();
    for (const adapter of names) {
      const rec = (r.published || {})[adapter];
      const state = failed[adapter] ? "push failed" : rec && here[adapter] && rec.revision !== here[adapter] ? "outdated" : "current";
      rows.push({ replica: r.name, adapter, revision: rec?.revision || null, publishedAt: rec?.published_at || null,
        state, failed: failed[adapter] || null });
    }
  }
  return rows;
}

export async function render(root, ctx) {
  const head = h("div", { id: "overview-head" });
  const tiles = h("div", { class: "tiles", id: "overview-tiles" });
  const chartBox = h("div", { id: "throughput-chart" });
  const checks = h("div", { id: "overview-checks" });
  const err = h("div");
  const replicaBox = h("div", { id: "overview-replicas" });
  const publicationBox = h("div", { id: "overview-publications" });
  root.append(err, card(null, head), tiles,
    card("Decode throughput", h("p", { class: "muted", id: "throughput-source" }, ""), chartBox), card("Health checks", checks));

  const hasDecodeStats = await hasRoute("/v1/stats/decode");
  if (await hasRoute("/v1/replicas")) {
    root.append(card("Replicas", h("p", { class: "muted small" },
      "Other servers this one polls every 10 s, publishes adapters to and fans evals out over (kiln replicas add)."), replicaBox),
    card("Published adapters", h("p", { class: "muted small" },
      "Which revision of each adapter every replica serves, as published from here (POST /v1/adapters/{name}/publish). " +
      "A failed push leaves the replica on the revision shown."), publicationBox));
    ctx.every(5000, async () => {
      const [list, stored] = await Promise.all([get("/v1/replicas").catch(() => null), get("/v1/adapters").catch(() => null)]);
      if (!list) return;
      const rows = publicationRows(list.data, stored?.available || []);
      clear(publicationBox, rows.length === 0 ? h("p", { class: "muted" }, "Nothing published to a replica yet.")
        : table(["replica", "adapter", "serving", "published", "state"], rows.map((p) => h("tr", {},
          h("td", {}, p.replica), h("td", {}, p.adapter),
          h("td", { class: "small", title: p.revision || "" }, p.revision ? shortHash(p.revision) : "—"),
          h("td", { class: "small" }, p.publishedAt ? fmtTime(p.publishedAt) : "—"),
          h("td", { class: "small" }, badge(p.state, PUBLICATION_KIND[p.state] || ""),
            p.failed ? h("span", { class: "muted", title: p.failed.error || "" },
              ` ${shortHash(p.failed.revision)} failed after ${p.failed.attempts} attempt(s): ${p.failed.error || ""}`) : null)))));
      clear(replicaBox, table(["name", "kind", "url", "state", "base model", "adapters", "problem"],
        list.data.map((r) => h("tr", {}, h("td", {}, r.name), h("td", {}, r.kind), h("td", { class: "small" }, r.url),
          h("td", {}, stateBadge(r.status.state), " ", r.status.compatible === false ? badge("other base", "bad") : null),
          h("td", {}, (r.status.base_models || []).join(", ") || "—"),
          h("td", { class: "small" }, Object.entries(r.published || {}).map(([a, rec]) => `${a} ${shortHash(rec.revision)}`).join(", ") || "—"),
          h("td", { class: "small muted" }, r.status.compatibility_problem || r.status.error || "")))));
    });
  }
  let config = null, info = null;
  let prev = null; // previous /metrics scrape {t, tokens, itlSum, itlCount}
  const history = [];

  const refreshStatic = async () => {
    [config, info] = await Promise.all([get("/v1/config"), get("/ui/api/info").catch(() => null)]);
  };
  await refreshStatic().catch((e) => clear(err, errorBox(e)));

  ctx.every(2000, async () => {
    let health;
    try {
      health = await get("/health");
    } catch (e) {
      // 503 while loading or degraded still carries a body, but get() throws: show the message
      clear(err, errorBox(e));
      return;
    }
    clear(err);
    const [metricsText, decode] = await Promise.all([
      get("/metrics").catch(() => ""),
      hasDecodeStats ? get("/v1/stats/decode").catch(() => null) : null,
    ]);
    const m = parseMetrics(typeof metricsText === "string" ? metricsText : "");
    const now = performance.now() / 1000;
    const tokens = counter(m, "kiln_tokens_generated");
    const itlSum = metric(m, "kiln_request_itl_seconds_sum"), itlCount = metric(m, "kiln_request_itl_seconds_count");
    let tokps = null, itlMs = null, source;
    if (decode) {
      tokps = pick(decode, [/tok.*per_s/i, /tokens_per_s/i, /tok_s$/i, /throughput/i])[1];
      const [itlKey, itl] = pick(decode, [/itl.*mean/i, /mean.*itl/i, /itl.*p50/i, /itl/i]);
      // a key in seconds (itl_s, itl_seconds.mean) rather than milliseconds
      itlMs = itl !== null && /(_s|_sec|_seconds)(\.|$)/i.test(itlKey) ? itl * 1000 : itl;
      // no token in the window: a gap of 0 ms would read as a measurement
      if (decode.sample_count === 0) itlMs = null;
      source = "from GET /v1/stats/decode (rolling window)";
    }
    if (tokps === null && prev && tokens !== null) {
      tokps = Math.max(0, (tokens - prev.tokens) / Math.max(1e-3, now - prev.t));
      const dc = itlCount - prev.itlCount;
      itlMs = dc > 0 ? (1000 * (itlSum - prev.itlSum)) / dc : null;
      source = "derived from /metrics: tokens generated and inter-token gaps between two scrapes, 2 s apart";
    }
    if (tokens !== null) prev = { t: now, tokens, itlSum: itlSum || 0, itlCount: itlCount || 0 };
    if (tokps !== null) {
      history.push([now, tokps]);
      while (history.length > HISTORY) history.shift();
    }

    const cm = config?.model || {};
    // what the weights resolved to (the model section), and "auto" beside it when the setting chose it
    const asked = config?.settings?.model?.quantization || config?.effective_inference_config?.model?.quantization;
    const served = cm.quantization || asked;
    const quantText = !served ? null
      : (served === "none" ? "dense (no quantization)" : `quantization ${served}`) + (asked === "auto" && served !== "auto" ? " (auto)" : "");
    const device = cm.device || info?.device || "—";
    const isa = info?.cpu_isa ? `CPU ${info.cpu_isa}` : (device.startsWith("cpu") ? `CPU (${info?.kernels || "kernels ?"})` : device);
    clear(head,
      h("div", { class: "model-line" },
        h("span", { class: "model-id", id: "model-id" }, cm.served_model_id || health.model || "no model"),
        stateBadge(health.status)),
      h("div", { class: "muted", id: "model-summary" }, [health.model, cm.architecture, cm.format && `${cm.format} weights`,
        cm.dtype, quantText, health.backend].filter(Boolean).join(" · ")),
      h("div", { class: "muted small" }, `weights: ${cm.path || "—"}`));

    const sched = health.scheduler || {};
    const usage = metric(m, "kiln_kv_cache_usage_ratio") ?? (sched.blocks_total ? sched.blocks_used / sched.blocks_total : null);
    const hitTokens = counter(m, "kiln_prefix_cache_hit_tokens") || 0;
    const computed = counter(m, "kiln_request_prefill_tokens_completed") || 0;
    const hitRate = hitTokens + computed > 0 ? hitTokens / (hitTokens + computed) : null;
    const reqOk = metric(m, "kiln_requests_total", { status: "ok" });
    const active = metric(m, "kiln_active_requests");
    clear(tiles,
      tile("Device", isa, `${device}${info?.kernels ? ` · kernels ${info.kernels}` : ""}`, "tile-device"),
      tile("Uptime", fmtDuration(health.uptime_seconds), `version ${health.version}`, "tile-uptime"),
      tile("Decode", tokps === null ? "—" : `${fmtNum(tokps)} tok/s`, itlMs === null ? (tokps === 0 ? "idle" : "ITL —") : `ITL ${fmtNum(itlMs, 1)} ms`, "tile-decode"),
      tile("Sequences", `${sched.running ?? 0} running`, `${sched.waiting ?? 0} waiting${active !== null ? ` · ${active} requests in flight` : ""}`, "tile-seqs"),
      tile("KV cache", fmtPct(usage), `${sched.blocks_used ?? 0} / ${sched.blocks_total ?? 0} blocks · ${fmtNum(health.gpu_memory?.kv_cache_gb * 1024, 0)} MiB`, "tile-kv"),
      tile("Prefix cache", hitRate === null ? "—" : `${fmtPct(hitRate)} hit`, `${fmtNum(hitTokens, 0)} prompt tokens reused`, "tile-prefix"),
      tile("Active adapter", health.active_adapter || "base", `${health.adapters_loaded} stored`, "tile-adapter"),
      tile("Requests", reqOk === null ? "—" : fmtNum(reqOk, 0), `ok · ${fmtNum(counter(m, "kiln_tokens_generated"), 0)} tokens generated`, "tile-requests"));

    document.getElementById("throughput-source").textContent = source || "waiting for a second sample…";
    const t0 = history.length ? history[0][0] : 0;
    clear(chartBox, lineChart([{ name: "tok/s", points: history.map(([t, v]) => [t - t0, v]) }],
      { height: 180, xLabel: "seconds", yLabel: "tok/s", yMin: 0, yMaxAtLeast: 10 }));
    if (decode) chartBox.append(h("details", {}, h("summary", {}, "decode stats"), h("pre", { class: "json" }, JSON.stringify(decode, null, 2))));

    clear(checks, h("ul", { class: "checks" }, (health.checks || []).map((c) =>
      h("li", {}, badge(c.pass ? "pass" : "fail", c.pass ? "good" : "bad"), " ", c.name))),
      config?.effective_config_hash ? h("p", { class: "muted small" }, `effective config ${shortHash(config.effective_config_hash)}`) : null);
  });
}
