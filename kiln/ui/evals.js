// Evals: registered suites, run and compare forms, the job list with progress, and a job's results:
// accuracy with Wilson intervals as a chart, per-tag breakdown, paired flips against run 0 (with the
// exact sign test), and the self-contained HTML report.

import { ApiError, apiKey, del, get, post, q, request } from "./api.js";
import { color, rateBars } from "./charts.js";
import { act, badge, card, clear, details, errorBox, field, fmtNum, fmtPct, fmtTime, h, input, json, select, stateBadge, table, toast } from "./dom.js";

const ACTIVE = ["queued", "running"];
const SUITE_TEMPLATE = JSON.stringify({
  name: "smoke", schema_version: 2,
  default_scorer: { kind: "contains", phrases: ["Paris"] },
  generation: { max_tokens: 24, temperature: 0 },
  examples: [
    { id: "capital", messages: [{ role: "user", content: "What is the capital of France?" }], tags: ["geo"] },
    { id: "city", messages: [{ role: "user", content: "Name the largest city in France." }], tags: ["geo"] },
  ],
}, null, 2);

const label = (adapter) => adapter || "<base>";

// Two-sided exact sign test over the discordant pairs (as kiln.evals.stats does).
function signTestP(improved, regressed) {
  const n = improved + regressed;
  if (!n) return 1;
  const k = Math.min(improved, regressed);
  let logC = 0, tail = 0;
  for (let i = 0; i <= k; i++) {
    if (i > 0) logC += Math.log((n - i + 1) / i);
    tail += Math.exp(logC - n * Math.LN2);
  }
  return Math.min(1, 2 * tail);
}

export function pairedFlips(runs) {
  const kinds = (run) => new Map((run.aggregated_outcomes || []).map((o) => [o.example_id, o.kind]));
  const base = kinds(runs[0]);
  return runs.slice(1).map((run, i) => {
    const after = kinds(run);
    const c = { both_pass: 0, regressed: 0, improved: 0, both_fail: 0, flips: [] };
    for (const [id, before] of base) {
      if (!after.has(id)) continue;
      const was = before === "pass", now = after.get(id) === "pass";
      const cls = was && now ? "both_pass" : was ? "regressed" : now ? "improved" : "both_fail";
      c[cls]++;
      if (cls === "regressed" || cls === "improved") c.flips.push({ example_id: id, class: cls });
    }
    return { candidate: label(run.adapter), index: i + 1, ...c, p: signTestP(c.improved, c.regressed) };
  });
}

function progressBar(done, total) {
  const f = total ? done / total : 0;
  return h("div", { class: "progress" }, h("div", { class: "progress-fill", style: { width: `${Math.round(100 * f)}%` } }));
}

async function openReport(jobId) {
  const resp = await request("GET", `/ui/api/eval-report/${q(jobId)}`, { raw: true });
  const url = URL.createObjectURL(new Blob([await resp.text()], { type: "text/html" }));
  window.open(url, "_blank");
}

export async function render(root, ctx) {
  const err = h("div");
  const suitesBox = h("div", { id: "eval-suites" });
  const jobsBox = h("div", { id: "eval-jobs" });
  const detailBox = h("div", { id: "eval-detail" });
  let selected = ctx.params.get("job");
  let suites = [], adapters = [];
  const forms = h("div");
  root.append(err, h("div", { class: "cols" }, card("Suites", suitesBox), forms), card("Jobs", jobsBox), detailBox);

  async function loadLists() {
    [suites, adapters] = await Promise.all([
      get("/v1/eval/suites").then((r) => r.suites || []),
      get("/v1/adapters").then((r) => (r.available || []).map((a) => a.name)).catch(() => [])]);
    clear(suitesBox, table(["suite", "examples", "k", "scorer", "tags", ""], suites.map((s) =>
      h("tr", { "data-suite": s.name },
        h("td", {}, h("strong", {}, s.name), s.description ? h("div", { class: "muted small" }, s.description) : null),
        h("td", {}, s.num_examples), h("td", {}, s.completions_per_example), h("td", {}, s.default_scorer_kind),
        h("td", {}, Object.entries(s.tags || {}).map(([t, n]) => badge(`${t} ${n}`, "muted"))),
        h("td", {}, h("button", { class: "small danger", onclick: (e) => {
          if (!confirm(`Delete suite ${s.name}?`)) return;
          act(e.currentTarget, null, async () => { await del(`/v1/eval/suites/${q(s.name)}`); loadLists(); });
        } }, "Delete")))), { id: "suites-table" }),
    details("Register a suite (JSON)", registerForm()));
    clear(forms, runForm(), compareForm());
  }

  function registerForm() {
    const text = h("textarea", { rows: 12, id: "suite-json", class: "mono" }, SUITE_TEMPLATE);
    const out = h("div");
    const b = h("button", { class: "primary", id: "suite-save" }, "Save suite");
    b.onclick = () => act(b, out, async () => {
      let body;
      try { body = JSON.parse(text.value); } catch (e) { throw new ApiError(0, { message: `Not JSON: ${e.message}` }); }
      const r = await post("/v1/eval/suites?force=true", body);
      toast(`suite ${r.name} ${r.status}`);
      loadLists();
    });
    return h("div", {}, text, b, out);
  }

  const targetOptions = () => [["__active__", "server default (active adapter)"], ["", "base model"], ...adapters.map((a) => [a, a])];

  function runForm() {
    const suite = select(suites.map((s) => s.name), { id: "run-suite" });
    const target = select(targetOptions(), { id: "run-adapter" });
    const seed = input({ id: "run-seed", type: "number", min: "0", placeholder: "random" });
    const out = h("div");
    const b = h("button", { class: "primary", id: "run-submit" }, "Run");
    b.onclick = () => act(b, out, async () => {
      if (!suite.value) throw new ApiError(0, { message: "Register a suite first." });
      const body = { suite: suite.value };
      if (target.value !== "__active__") body.adapter = target.value || null;
      if (seed.value) body.seed = Number(seed.value);
      const r = await post("/v1/eval/run", body);
      toast(r.message);
      selected = r.job_id;
      refresh();
    });
    return card("Run a suite", h("div", { class: "grid3" }, field("suite", suite), field("adapter", target), field("seed", seed)), b, out);
  }

  function compareForm() {
    const suite = select(suites.map((s) => s.name), { id: "cmp-suite" });
    const boxes = [["", "base model"], ...adapters.map((a) => [a, a])].map(([v, l], i) =>
      h("label", { class: "check" }, h("input", { type: "checkbox", value: v, class: "cmp-adapter", checked: i < 2 }), ` ${l}`));
    const out = h("div");
    const b = h("button", { class: "primary", id: "cmp-submit" }, "Compare");
    b.onclick = () => act(b, out, async () => {
      const chosen = boxes.map((l) => l.querySelector("input")).filter((x) => x.checked).map((x) => x.value);
      if (!suite.value) throw new ApiError(0, { message: "Register a suite first." });
      const r = await post("/v1/eval/compare", { suite: suite.value, adapters: chosen });
      toast(r.message);
      selected = r.job_id;
      refresh();
    });
    return card("Compare adapters", field("suite", suite), h("div", { class: "checks-row" }, boxes),
      h("p", { class: "muted small" }, "The first checked target is the baseline; flips are counted against it."), b, out);
  }

  const jobsById = new Map();
  async function refreshJobs() {
    const { jobs } = await get("/v1/eval/jobs");
    for (const j of jobs) jobsById.set(j.job_id, j);
    if (!selected && jobs.length) selected = jobs[0].job_id;
    clear(jobsBox, table(["job", "suite", "targets", "state", "progress", "accuracy", "submitted"], jobs.map((j) =>
      h("tr", { class: `clickable ${j.job_id === selected ? "selected" : ""}`, "data-job": j.job_id,
        onclick: () => { selected = j.job_id; lastDetail = null; refreshJobs(); refreshDetail(); } },
        h("td", {}, h("code", {}, j.job_id.slice(0, 14)), h("div", { class: "muted small" }, j.submission_kind)),
        h("td", {}, j.suite_name),
        h("td", {}, (j.adapters || []).map(label).join(", ")),
        h("td", {}, stateBadge(j.state)),
        h("td", {}, progressBar(j.progress.examples_completed, j.progress.examples_total),
          h("span", { class: "small muted" }, `${j.progress.examples_completed}/${j.progress.examples_total}`)),
        h("td", {}, j.headline_accuracy === null ? "—" : fmtPct(j.headline_accuracy)),
        h("td", {}, fmtTime(j.submitted_at_iso)))), { id: "eval-jobs-table" }));
  }

  let lastDetail = null;
  async function refreshDetail() {
    if (!selected) return;
    if (lastDetail && lastDetail.job_id === selected && !ACTIVE.includes(lastDetail.state)) return;
    let r;
    try { r = await get(`/v1/eval/jobs/${q(selected)}`); } catch (e) { clear(detailBox, errorBox(e)); return; }
    lastDetail = r;
    const runs = r.runs || [];
    const out = h("div");
    const active = ACTIVE.includes(r.state);
    const info = jobsById.get(r.job_id);
    const suiteName = runs[0]?.suite_name || info?.suite_name;
    const actions = h("div", { class: "row wrap" },
      stateBadge(r.state),
      suiteName ? h("span", {}, `suite `, h("strong", {}, suiteName)) : null,
      info?.source_training_job_id ? h("a", { href: `#/training?job=${q(info.source_training_job_id)}` }, "training job") : null,
      r.effective_seed ? h("span", { class: "muted small" }, `seed ${r.effective_seed}`) : null,
      h("span", { class: "spacer" }),
      runs.length ? h("a", { href: `/ui/api/eval-report/${q(r.job_id)}`, target: "_blank", id: "eval-report-link", class: "button",
        onclick: (e) => { if (apiKey()) { e.preventDefault(); act(null, out, () => openReport(r.job_id)); } } }, "HTML report") : null,
      !active && runs.length ? h("button", { onclick: (e) => act(e.currentTarget, out, async () => {
        const rr = await post(`/v1/eval/jobs/${q(r.job_id)}/rerun`, {});
        toast(rr.message); selected = rr.job_id; lastDetail = null; refresh();
      }) }, "Re-run failures") : null,
      h("button", { class: active ? "" : "danger", onclick: (e) => act(e.currentTarget, out, async () => {
        if (!active && !confirm("Delete this job's record?")) return;
        await del(`/v1/eval/jobs/${q(r.job_id)}`);
        if (!active) selected = null;
        lastDetail = null; refresh();
      }) }, active ? "Cancel" : "Delete"));
    const bars = runs.map((run, i) => ({ label: `${i}: ${label(run.adapter)}`, value: run.metrics.accuracy,
      lower: run.metrics.accuracy_confidence_interval?.lower, upper: run.metrics.accuracy_confidence_interval?.upper,
      n: run.metrics.num_examples, color: color(i) }));
    const tags = [...new Set(runs.flatMap((run) => Object.keys(run.metrics.tag_breakdown || run.metrics.pass_rate_by_tag || {})))].sort();
    const tagBars = tags.flatMap((t) => runs.map((run, i) => {
      const b = (run.metrics.tag_breakdown || {})[t];
      const rate = b ? b.pass_rate : run.metrics.pass_rate_by_tag?.[t];
      return rate === undefined ? null : { label: `${t} · ${label(run.adapter)}`, value: rate, lower: b?.confidence_interval?.lower,
        upper: b?.confidence_interval?.upper, n: b?.num_examples, color: color(i) };
    }).filter(Boolean));
    const flips = runs.length > 1 ? pairedFlips(runs) : [];
    clear(detailBox, card(`Eval job ${r.job_id}`, actions, out,
      r.progress && active ? h("div", {}, progressBar(r.progress.examples_completed, r.progress.examples_total),
        h("p", { class: "muted small" }, `${r.progress.examples_completed} / ${r.progress.examples_total} examples · running accuracy ${fmtPct(r.progress.running_accuracy)}`)) : null,
      r.error ? errorBox({ message: r.error }) : null,
      runs.length ? [
        h("h3", {}, "Accuracy (95% Wilson interval)"),
        rateBars(bars, { id: "accuracy-chart", title: "accuracy by run" }),
        table(["run", "adapter", "accuracy", "95% CI", "pass", "fail", "invalid", "error", "mean score", "p50 latency", "elapsed"], runs.map((run, i) => {
          const m = run.metrics, ci = m.accuracy_confidence_interval || {};
          return h("tr", {}, h("td", {}, i), h("td", {}, label(run.adapter)), h("td", {}, fmtPct(m.accuracy)),
            h("td", {}, `${fmtPct(ci.lower)} – ${fmtPct(ci.upper)}`), h("td", {}, m.num_pass), h("td", {}, m.num_fail),
            h("td", {}, m.num_invalid), h("td", {}, m.num_error), h("td", {}, fmtNum(m.mean_score, 3)),
            h("td", {}, `${fmtNum(m.latency?.p50_ms, 0)} ms`), h("td", {}, `${fmtNum(m.elapsed_secs, 1)} s`));
        }), { id: "runs-table" }),
        tagBars.length ? [h("h3", {}, "Per tag"), rateBars(tagBars, { id: "tag-chart", title: "pass rate by tag" })] : null,
        flips.length ? [h("h3", {}, "Paired comparison with run 0"),
          table(["candidate", "paired", "improved", "regressed", "both pass", "both fail", "sign test p", ""], flips.map((f) =>
            h("tr", {}, h("td", {}, `${f.index}: ${f.candidate}`), h("td", {}, f.both_pass + f.both_fail + f.improved + f.regressed),
              h("td", { class: "good-text" }, f.improved), h("td", { class: "bad-text" }, f.regressed), h("td", {}, f.both_pass),
              h("td", {}, f.both_fail), h("td", {}, f.p.toPrecision(3)),
              h("td", {}, f.p < 0.05 ? badge("significant", "warn") : badge("within chance", "muted")))), { id: "flips-table" }),
          flips.map((f) => f.flips.length ? details(`${f.flips.length} flipped example(s), ${f.candidate}`,
            h("ul", { class: "flip-list" }, f.flips.map((x) => h("li", {}, badge(x.class, x.class === "improved" ? "good" : "bad"), " ", h("code", {}, x.example_id))))) : null)] : null,
        details("examples", runs.map((run, i) => h("div", {}, h("h4", {}, `run ${i}: ${label(run.adapter)}`),
          table(["example", "outcome", "score", "tags"], (run.aggregated_outcomes || []).slice(0, 200).map((o) =>
            h("tr", {}, h("td", {}, h("code", {}, o.example_id)), h("td", {}, badge(o.kind, o.kind === "pass" ? "good" : o.kind === "fail" ? "bad" : "warn")),
              h("td", {}, fmtNum(o.score, 2)), h("td", {}, (o.tags || []).join(", ")))))))),
        r.replay_verdict ? details("replay verdict", json(r.replay_verdict)) : null,
      ] : h("p", { class: "muted" }, active ? "Running…" : "No finished runs.")));
  }

  async function refresh() {
    try { await refreshJobs(); clear(err); } catch (e) { clear(err, errorBox(e)); }
    await refreshDetail();
  }

  try { await loadLists(); } catch (e) { clear(err, errorBox(e)); }
  ctx.every(1500, refresh);
}
