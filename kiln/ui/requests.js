// Recent requests: GET /v1/stats/recent-requests (newest first) as a table with the thinking-budget
// outcome of each. On a server without that route the page says so.

import { get, hasRoute } from "./api.js";
import { badge, card, clear, errorBox, fmtNum, fmtTime, h, input, table } from "./dom.js";

// The outcome label of a thinking-budget record (kiln.core.thinking_budget.outcome_label).
export function outcomeLabel(r) {
  if (!r) return null;
  if (!r.configured) return "unconfigured";
  if (r.applied === false) return "inert";
  if (!("closed" in r)) return "unresolved";
  if (r.triggered) return r.closed ? r.trigger : "interrupted";
  return r.closed ? "natural_close" : "unclosed";
}

const OUTCOME_TEXT = { tokens: "forced: token limit", time: "forced: time limit", max_tokens: "forced: max_tokens",
  natural_close: "closed naturally", unconfigured: "no budget", inert: "inert (not applied)", unresolved: "unresolved",
  unclosed: "never closed", interrupted: "forced, interrupted" };
const OUTCOME_KIND = { natural_close: "good", unconfigured: "muted", inert: "muted", unresolved: "warn", unclosed: "warn", interrupted: "bad" };

function ms(v) { return v === null || v === undefined ? "—" : `${fmtNum(v, 0)} ms`; }

function adapterText(a) {
  if (a === null || a === undefined || a === "") return "base";
  if (Array.isArray(a)) return a.map((p) => `${p.name}×${p.scale}`).join(" + ");
  if (typeof a === "object") return a.name || JSON.stringify(a);
  return String(a);
}

export async function render(root, ctx) {
  const box = h("div", { id: "recent-requests" });
  const err = h("div");
  if (!(await hasRoute("/v1/stats/recent-requests"))) {
    root.append(card("Recent requests", h("p", { id: "recent-missing" },
      "This server does not record recent requests (GET /v1/stats/recent-requests answers 404). ",
      "Upgrade the server to see the last chat and batch completions here.")));
    return;
  }
  const limit = input({ type: "number", min: "1", value: "50", id: "recent-limit", class: "narrow" });
  root.append(err, card("Recent requests", h("div", { class: "row" }, h("span", { class: "muted" }, "newest first (by start time) · show"), limit), box));
  ctx.every(3000, async () => {
    let body;
    try { body = await get(`/v1/stats/recent-requests?limit=${Number(limit.value) || 50}`); } catch (e) { clear(err, errorBox(e)); return; }
    clear(err);
    // the server lists them as they finished; the time column is when each started, so sort by it
    // (a long request that finished last would otherwise sit above newer short ones)
    const records = (Array.isArray(body) ? body : body.data || body.requests || body.records || [])
      .map((r, i) => [r, i]).sort(([a, i], [b, j]) => (b.created ?? 0) - (a.created ?? 0) || i - j).map(([r]) => r);
    clear(box, table(["time", "request", "adapter", "prompt → completion", "tokens", "duration", "TTFT", "finish", "status", "thinking budget"],
      records.map((r) => {
        const tb = r.thinking_budget;
        const outcome = outcomeLabel(tb);
        const tokens = r.tokens || r.usage || {};
        const pt = r.prompt_tokens ?? tokens.prompt_tokens ?? tokens.prompt, ct = r.completion_tokens ?? tokens.completion_tokens ?? tokens.completion;
        return h("tr", { "data-request": r.id },
          h("td", {}, fmtTime(r.created)),
          h("td", {}, h("code", { title: r.request_id || "" }, String(r.id || r.request_id || "").slice(0, 18)), r.streamed ? h("div", { class: "muted small" }, "streamed") : null),
          h("td", {}, adapterText(r.adapter ?? r.adapters)),
          h("td", { class: "preview-cell" }, h("div", { class: "small" }, r.prompt_preview ?? r.prompt ?? ""),
            // a request that failed or was refused says why, where its answer would be
            r.error && !(r.completion_preview ?? r.completion)
              ? h("div", { class: "small bad-text request-error" }, `✕ ${r.error}`)
              : h("div", { class: "small muted" }, `→ ${r.completion_preview ?? r.completion ?? ""}`)),
          h("td", {}, `${pt ?? "?"} / ${ct ?? "?"}`),
          h("td", {}, ms(r.duration_ms ?? (r.duration_s !== undefined ? r.duration_s * 1000 : r.duration))),
          h("td", {}, ms(r.ttft_ms ?? r.ttft)),
          h("td", {}, r.finish_reason || "—"),
          h("td", {}, badge(r.status || "—", r.status === "ok" || r.status === "completed" ? "good" : r.status ? "bad" : "")),
          h("td", { title: outcome || "" }, outcome ? badge(OUTCOME_TEXT[outcome] || outcome, OUTCOME_KIND[outcome] || "info") : "—",
            tb && tb.thinking_tokens !== undefined ? h("div", { class: "muted small" }, `${tb.thinking_tokens} thinking tokens`) : null));
      }), { id: "recent-table" }));
  });
}
