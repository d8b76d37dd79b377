// Data: datasets (upload, split summary, rows, delete) and judgment sets (winner histogram, rows,
// compile into SFT data, validate a judge adapter on the held-out rows, train a preference adapter (DPO)
// from the A/B rows, export them as TRL or OpenAI preference JSONL, delete).

import { ApiError, del, get, post, q, request } from "./api.js";
import { countBars, stackBar } from "./charts.js";
import { act, badge, card, clear, details, errorBox, field, fmtBytes, fmtTime, h, input, json, saveBlob, select, shortHash, table, toast } from "./dom.js";

const SPLIT_COLORS = { train: "#2f6fde", validation: "#b08900", holdout: "#1f9d55" };
const WINNER_COLORS = { a: "#2f6fde", b: "#e0662d", tie: "#9b4dca", skip: "#8a94a0" };

function preview(row) {
  const msgs = row.messages || row.prompt || [];
  const text = Array.isArray(msgs) ? msgs.map((m) => `${m.role}: ${typeof m.content === "string" ? m.content : JSON.stringify(m.content)}`).join("\n") : JSON.stringify(row);
  return text.length > 300 ? `${text.slice(0, 300)}…` : text;
}

export async function render(root, ctx) {
  const err = h("div");
  const dsBox = h("div", { id: "datasets" });
  const jBox = h("div", { id: "judgments" });
  const detail = h("div", { id: "data-detail" });
  root.append(err, h("div", { class: "cols" }, card("Datasets", dsBox, details("Upload a dataset", uploadForm())),
    card("Judgment sets", jBox, details("New judgment set", createJudgmentForm()))), detail);

  async function refreshDatasets() {
    const { datasets } = await get("/v1/eval/datasets");
    clear(dsBox, table(["dataset", "rows", "split", ""], datasets.map((d) => {
      const c = d.split_counts || {};
      return h("tr", { "data-dataset": d.name, class: "clickable", onclick: () => showDataset(d.name) },
        h("td", {}, h("strong", {}, d.name), h("div", { class: "muted small" }, `${d.format} · ${fmtBytes(d.size_bytes)}`)),
        h("td", {}, d.num_rows),
        h("td", {}, stackBar(["train", "validation", "holdout"].map((k) => ({ label: k, value: c[k] || 0, color: SPLIT_COLORS[k] }))),
          h("div", { class: "small muted" }, `${c.train ?? 0} train / ${c.validation ?? 0} validation / ${c.holdout ?? 0} holdout`)),
        h("td", {}, h("button", { class: "small danger", onclick: (e) => {
          e.stopPropagation();
          if (!confirm(`Delete dataset ${d.name}?`)) return;
          act(e.currentTarget, null, async () => { await del(`/v1/eval/datasets/${q(d.name)}`); refreshDatasets(); clear(detail); });
        } }, "Delete")));
    }), { id: "datasets-table" }));
  }

  async function showDataset(name, split = "") {
    const out = h("div");
    clear(detail, card(`Dataset ${name}`, out));
    await act(null, out, async () => {
      const [m, rows] = await Promise.all([get(`/v1/eval/datasets/${q(name)}`),
        get(`/v1/eval/datasets/${q(name)}/rows?limit=25${split ? `&split=${q(split)}` : ""}`)]);
      const c = m.split_counts || {};
      const splitSel = select([["", "all rows"], "train", "validation", "holdout"]);
      splitSel.value = split;
      splitSel.onchange = () => showDataset(name, splitSel.value);
      clear(out,
        h("p", {}, `${m.num_rows} rows · ${m.format} · ${m.num_groups} groups · ${m.num_sessions} sessions · updated ${fmtTime(m.updated_at)}`),
        h("p", {}, ["train", "validation", "holdout"].map((k) => [badge(`${k} ${c[k] ?? 0}`, ""), " "]),
          h("span", { class: "muted small" }, `split ${JSON.stringify(m.split_config)} · corpus ${shortHash(m.corpus_sha256)}`)),
        stackBar(["train", "validation", "holdout"].map((k) => ({ label: k, value: c[k] || 0, color: SPLIT_COLORS[k] })), { width: 600, height: 18 }),
        h("div", { class: "row" }, field("show", splitSel)),
        table(["#", "row"], rows.rows.map((r, i) => h("tr", {}, h("td", {}, i), h("td", {}, h("pre", { class: "row-preview" }, preview(r)))))),
        m.description ? h("p", { class: "muted" }, m.description) : null,
        details("stats", json(m.stats)));
    });
  }

  function uploadForm() {
    const name = input({ id: "ds-name", placeholder: "dataset name" });
    const format = select([["sft_chat", "sft_chat"], ["grpo_groups", "grpo_groups"], ["raw", "raw"]], { id: "ds-format" });
    const desc = input({ id: "ds-desc", placeholder: "description (optional)" });
    const file = h("input", { type: "file", id: "ds-file", accept: ".jsonl,.json,.txt" });
    const text = h("textarea", { id: "ds-text", rows: 4, placeholder: "…or paste JSONL rows here" });
    const out = h("div");
    const b = h("button", { class: "primary", id: "ds-upload" }, "Upload");
    b.onclick = () => act(b, out, async () => {
      const form = new FormData();
      form.append("name", name.value.trim());
      form.append("format", format.value);
      if (desc.value.trim()) form.append("description", desc.value.trim());
      if (file.files[0]) form.append("file", file.files[0]);
      else if (text.value.trim()) form.append("file", new Blob([text.value], { type: "application/x-ndjson" }), "rows.jsonl");
      else throw new ApiError(0, { message: "Choose a file or paste rows." });
      const r = await request("POST", "/v1/eval/datasets/upload", { form });
      toast(`dataset ${r.name || name.value} uploaded (${r.num_rows ?? "?"} rows)`);
      refreshDatasets();
    });
    return h("div", {}, h("div", { class: "grid3" }, field("name", name), field("format", format), field("description", desc)),
      field("file", file), text, b, out);
  }

  let judgmentNames = [];
  async function refreshJudgments() {
    const { judgments } = await get("/v1/judgments");
    judgmentNames = judgments.map((j) => j.name);
    clear(jBox, table(["set", "rows", "winners", ""], judgments.map((j) => {
      const hist = j.winner_histogram || {};
      return h("tr", { "data-judgment": j.name, class: "clickable", onclick: () => showJudgment(j.name) },
        h("td", {}, h("strong", {}, j.name), h("div", { class: "muted small" }, `updated ${fmtTime(j.updated_at)}`)),
        h("td", {}, j.num_rows),
        h("td", {}, ["a", "b", "tie", "skip"].map((k) => badge(`${k} ${hist[k] || 0}`, "muted"))),
        h("td", {}, h("button", { class: "small danger", onclick: (e) => {
          e.stopPropagation();
          if (!confirm(`Delete judgment set ${j.name}?`)) return;
          act(e.currentTarget, null, async () => { await del(`/v1/judgments/${q(j.name)}`); refreshJudgments(); clear(detail); });
        } }, "Delete")));
    }), { id: "judgments-table" }));
  }

  function createJudgmentForm() {
    const name = input({ id: "j-name", placeholder: "name" });
    const desc = input({ id: "j-desc", placeholder: "description (optional)" });
    const out = h("div");
    const b = h("button", { class: "primary" }, "Create");
    b.onclick = () => act(b, out, async () => {
      await post("/v1/judgments", { name: name.value.trim(), description: desc.value.trim() || null });
      refreshJudgments();
    });
    return h("div", {}, h("div", { class: "grid2" }, field("name", name), field("description", desc)), b, out);
  }

  async function showJudgment(name) {
    const out = h("div");
    clear(detail, card(`Judgment set ${name}`, out));
    await act(null, out, async () => {
      const [m, { rows }, adapters] = await Promise.all([get(`/v1/judgments/${q(name)}`), get(`/v1/judgments/${q(name)}/rows`),
        get("/v1/adapters").then((r) => (r.available || []).map((a) => a.name)).catch(() => [])]);
      const hist = m.winner_histogram || {};
      const compileOut = h("div"), validateOut = h("div");
      const outName = input({ id: "compile-output", value: `${name}-sft` });
      const holdout = input({ id: "compile-holdout", type: "number", min: "0", placeholder: "default" });
      const skips = h("input", { type: "checkbox" });
      const compile = h("button", { class: "primary", id: "compile-submit" }, "Compile");
      compile.onclick = () => act(compile, compileOut, async () => {
        const body = { output_dataset: outName.value.trim(), include_skips: skips.checked };
        if (holdout.value) body.holdout_n = Number(holdout.value);
        const r = await post(`/v1/judgments/${q(name)}/compile`, body);
        clear(compileOut, h("div", { class: "ok-note" }, `✓ ${r.rows} SFT rows in dataset ${r.dataset.name} (${r.holdout_n} rows held out)`),
          (r.warnings || []).map((w) => h("div", { class: "error-hint" }, w)));
        refreshDatasets();
      });
      const judge = select([["", "base model"], ...adapters.map((a) => [a, a])], { id: "validate-adapter" });
      const vHoldout = input({ type: "number", min: "0", placeholder: "default" });
      const validate = h("button", { class: "primary", id: "validate-submit" }, "Validate judge");
      validate.onclick = () => act(validate, validateOut, async () => {
        const body = { adapter: judge.value };
        if (vHoldout.value) body.holdout_n = Number(vHoldout.value);
        const r = await post(`/v1/judgments/${q(name)}/validate`, body);
        clear(validateOut, h("div", { class: "ok-note" }, "✓ queued ", h("a", { href: `#/evals?job=${q(r.eval_job_id)}` }, r.eval_job_id),
          ` (suite ${r.validation_suite})`), (r.warnings || []).map((w) => h("div", { class: "error-hint" }, w)));
      });
      const abRows = (hist.a || 0) + (hist.b || 0);
      const exportOut = h("div");
      const exporter = (fmt) => h("button", { class: "small", id: `export-${fmt}`, onclick: (e) => act(e.currentTarget, exportOut, async () => {
        const resp = await request("GET", `/v1/judgments/${q(name)}/export?format=${fmt}`, { raw: true });
        saveBlob(await resp.blob(), `${name}.${fmt}.jsonl`);
      }) }, fmt === "trl" ? "TRL JSONL" : "OpenAI JSONL");
      const trainDpo = h("button", { class: "primary", id: "dpo-from-judgments", disabled: abRows === 0,
        onclick: () => ctx.go(`#/training?dpo=${q(name)}`) }, "Train a preference adapter from these");
      const preferences = h("div", { id: "judgment-preferences" }, h("h3", {}, "Learn from these preferences"),
        h("p", { class: "muted small" }, abRows
          ? `${abRows} A/B judgment${abRows === 1 ? "" : "s"} become DPO pairs (the winner's reply chosen, the other rejected); ties and skips are left out.`
          : "Only A/B judgments carry a preference; this set has none yet."),
        h("div", { class: "row wrap" }, trainDpo, h("span", { class: "muted small" }, "export:"), exporter("trl"), exporter("openai")), exportOut);
      clear(out,
        preferences,
        h("div", { class: "cols" },
          h("div", {}, h("h3", {}, "Winners"), countBars(["a", "b", "tie", "skip"].map((k) => ({ label: k, value: hist[k] || 0, color: WINNER_COLORS[k] })), { id: "winner-histogram" }),
            h("p", { class: "muted small" }, `${m.num_rows} row${m.num_rows === 1 ? "" : "s"}${m.last_compiled_at ? ` · last compiled ${fmtTime(m.last_compiled_at)} (${m.last_compiled_split} rows)` : ""}`)),
          h("div", {},
            h("h3", {}, "Compile to SFT data"), h("div", { class: "grid2" }, field("output dataset", outName), field("holdout rows", holdout)),
            h("label", { class: "check" }, skips, " include skips"), compile, compileOut,
            h("h3", {}, "Validate a judge adapter"), h("div", { class: "grid2" }, field("judge", judge), field("holdout rows", vHoldout)), validate, validateOut)),
        h("h3", {}, "Rows (newest first)"),
        table(["winner", "A", "B", "prompt", "responses"], rows.slice().reverse().slice(0, 50).map((r) =>
          h("tr", {}, h("td", {}, badge(r.winner, r.winner === "tie" || r.winner === "skip" ? "muted" : "info")),
            h("td", {}, r.adapter_a || "<base>"), h("td", {}, r.adapter_b || "<base>"),
            h("td", {}, h("pre", { class: "row-preview" }, preview(r))),
            h("td", {}, h("pre", { class: "row-preview" }, `A: ${r.response_a.slice(0, 160)}\nB: ${r.response_b.slice(0, 160)}`)))), { id: "judgment-rows" }));
    });
  }

  try {
    await Promise.all([refreshDatasets(), refreshJudgments()]);
  } catch (e) { clear(err, errorBox(e)); }
  if (ctx.params.get("judgment")) showJudgment(ctx.params.get("judgment"));
  else if (ctx.params.get("dataset")) showDataset(ctx.params.get("dataset"));
  else if (judgmentNames.length) showJudgment(judgmentNames[0]);
}
