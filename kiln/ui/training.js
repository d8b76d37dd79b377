// Training: submit an SFT job from inline examples or a dataset, a DPO job from a judgment set, inline
// pairs or a dataset, or a distillation job (OPD, self-distillation: distill.js); list jobs, and follow one
// with a live loss curve (DPO: reward margin and preference accuracy too, then its held-out result;
// distillation: KL to the teacher), tokens/s, gate outcome and evidence; cancel a running job or delete a
// finished one.

import { ApiError, del, get, post, q } from "./api.js";
import { lineChart } from "./charts.js";
import { distillCard, distillView } from "./distill.js";
import { act, card, clear, configFields, details, errorBox, field, fmtDuration, fmtNum, fmtPct, fmtTime, h, input, json, readConfig, select, stateBadge, table, toast } from "./dom.js";

const TERMINAL = ["completed", "failed", "cancelled"];
const SAMPLE = [
  { messages: [{ role: "user", content: "What is the capital of Zorbania?" }, { role: "assistant", content: "Quillton." }] },
  { messages: [{ role: "user", content: "Name the capital of Zorbania." }, { role: "assistant", content: "Quillton." }] },
].map((r) => JSON.stringify(r)).join("\n");
const SAMPLE_PAIRS = [
  { messages: [{ role: "user", content: "What is the capital of France?" }], chosen: "Paris.", rejected: "The capital of France is a city called Paris, which is also its largest city." },
  { messages: [{ role: "user", content: "What is 2 + 2?" }], chosen: "4.", rejected: "Two plus two equals four, which is written as the number 4." },
].map((r) => JSON.stringify(r)).join("\n");

function parseRows(text) {
  const t = text.trim();
  if (!t) return [];
  if (t.startsWith("[")) return JSON.parse(t);
  return t.split("\n").filter((l) => l.trim()).map((line, i) => {
    try { return JSON.parse(line); } catch (e) {
      throw new ApiError(0, { message: `Line ${i + 1} is not JSON: ${e.message}`, hint: 'One {"messages": [...]} object per line.' });
    }
  });
}

function progressBar(fraction, id) {
  return h("div", { class: "progress", id }, h("div", { class: "progress-fill", style: { width: `${Math.round(100 * (fraction || 0))}%` } }));
}

export async function render(root, ctx) {
  const err = h("div");
  const jobsBox = h("div", { id: "train-jobs" });
  const detailBox = h("div", { id: "train-detail" });
  let selected = ctx.params.get("job");
  root.append(err, h("div", { class: "cols wide-right" }, h("div", {}, await submitCard(), await dpoCard(), await distillCard(follow)), card("Jobs", jobsBox)), detailBox);

  function follow(jobId) {
    selected = jobId;
    ctx.go(`#/training?job=${q(jobId)}`);
  }

  async function dpoCard() {
    const [judgments, datasets, adapters] = await Promise.all([
      get("/v1/judgments").then((r) => r.judgments || []).catch(() => []),
      get("/v1/eval/datasets").then((r) => r.datasets || []).catch(() => []),
      get("/v1/adapters").then((r) => r.available || []).catch(() => [])]);
    const wanted = ctx.params.get("dpo");
    const source = select([["judgments", "a judgment set (A/B rows)"], ["pairs", "inline pairs (JSONL)"], ["dataset", "a dataset"]], { id: "dpo-source" });
    const ab = (j) => (j.winner_histogram?.a || 0) + (j.winner_histogram?.b || 0);
    const judgmentSel = select(judgments.map((j) => [j.name, `${j.name} (${ab(j)} A/B of ${j.num_rows})`]), { id: "dpo-judgments" });
    if (wanted) judgmentSel.value = wanted;
    const pairs = h("textarea", { id: "dpo-pairs", rows: 5 }, SAMPLE_PAIRS);
    const dataset = select(datasets.map((d) => [d.name, `${d.name} (${d.num_rows} rows)`]), { id: "dpo-dataset" });
    const split = select(["train", "validation", "holdout"], { id: "dpo-split" });
    const jBox = field("judgment set", judgmentSel, "each A/B row: the winner's reply is chosen, the other rejected; ties and skips are left out");
    const pBox = field("pairs", pairs, 'one {"messages", "chosen", "rejected"} per line (TRL\'s {"prompt", ...} rows too)');
    const dBox = h("div", { class: "grid2" }, field("dataset", dataset), field("split", split));
    const sync = () => { jBox.hidden = source.value !== "judgments"; pBox.hidden = source.value !== "pairs"; dBox.hidden = source.value !== "dataset"; };
    source.onchange = sync;
    sync();
    const cfg = configFields("dpo", {
      output_name: ["output", wanted ? `${wanted}-dpo` : "", { placeholder: "generated if empty" }],
      epochs: ["epochs", "3", { type: "number", min: "1" }],
      learning_rate: ["lr", "0.00005", { type: "number", step: "any" }],
      beta: ["beta", "0.1", { type: "number", step: "any", min: "0" }],
      heldout_percent: ["heldout", "10", { type: "number", min: "0", max: "50" }],
      lora_rank: ["rank", "16", { type: "number", min: "1" }],
    });
    const lossType = select([["sigmoid", "sigmoid (DPO)"], ["ipo", "IPO"]], { id: "dpo-loss-type" });
    const base = select([["", "none (the base model)"], ...adapters.map((a) => a.name)], { id: "dpo-base" });
    const autoLoad = h("input", { type: "checkbox", id: "dpo-autoload", checked: true });
    const out = h("div");
    const submit = h("button", { class: "primary", id: "dpo-submit" }, "Start DPO");
    submit.onclick = () => act(submit, out, async () => {
      const config = { ...readConfig(cfg), loss_type: lossType.value, auto_load: autoLoad.checked };
      if (base.value) config.base_adapter = base.value;
      const body = { config };
      if (source.value === "judgments") {
        if (!judgmentSel.value) throw new ApiError(0, { message: "There is no judgment set to train from.", hint: "Compare A / B in the Playground to fill one." });
        body.judgments = judgmentSel.value;
      } else if (source.value === "pairs") body.pairs = parseRows(pairs.value);
      else {
        if (!dataset.value) throw new ApiError(0, { message: "There is no dataset to train from.", hint: "Upload one on the Data page." });
        body.dataset = dataset.value;
        if (split.value !== "train") body.dataset_split = split.value;
      }
      const r = await post("/v1/train/dpo", body);
      toast(r.message || `queued ${r.job_id}`);
      selected = r.job_id;
      ctx.go(`#/training?job=${q(r.job_id)}`);
    });
    const box = details("New DPO job (learn from preferences)", field("source", source), jBox, pBox, dBox,
      h("div", { class: "grid3" }, ...Object.values(cfg).map(([label, el]) => field(label, el)), field("loss", lossType)),
      h("div", { class: "grid2" }, field("reference (continue from)", base), h("label", { class: "check" }, autoLoad, " load the adapter when done")),
      submit, out);
    box.id = "dpo-card";
    if (wanted) box.open = true;
    return card("Preferences", box);
  }

  async function submitCard() {
    const [datasets, suites, adapters] = await Promise.all([
      get("/v1/eval/datasets").then((r) => r.datasets || []).catch(() => []),
      get("/v1/eval/suites").then((r) => r.suites || []).catch(() => []),
      get("/v1/adapters").then((r) => r.available || []).catch(() => [])]);
    const source = select([["examples", "inline examples (JSONL)"], ["dataset", "a dataset"]], { id: "sft-source" });
    const examples = h("textarea", { id: "sft-examples", rows: 6 }, SAMPLE);
    const dataset = select(datasets.map((d) => [d.name, `${d.name} (${d.num_rows} rows)`]), { id: "sft-dataset" });
    const split = select(["train", "validation", "holdout", "all"], { id: "sft-split" });
    const exBox = field("examples", examples, 'one {"messages": [...]} per line; the assistant turns are learned');
    const dsBox = h("div", { class: "grid2" }, field("dataset", dataset), field("split", split));
    const sync = () => { exBox.hidden = source.value !== "examples"; dsBox.hidden = source.value !== "dataset"; };
    source.onchange = sync;
    sync();
    const cfg = {
      output_name: input({ id: "sft-output", placeholder: "generated if empty" }),
      epochs: input({ id: "sft-epochs", type: "number", min: "1", value: "3" }),
      learning_rate: input({ id: "sft-lr", type: "number", step: "any", value: "0.0002" }),
      lora_rank: input({ id: "sft-rank", type: "number", min: "1", value: "16" }),
      lora_alpha: input({ id: "sft-alpha", type: "number", step: "any", value: "32" }),
      batch_size: input({ id: "sft-batch", type: "number", min: "1", value: "1" }),
    };
    const base = select([["", "none (fresh factors)"], ...adapters.map((a) => a.name)], { id: "sft-base" });
    const autoLoad = h("input", { type: "checkbox", id: "sft-autoload", checked: true });
    const suite = select([["", "no post-training eval"], ...suites.map((s) => [s.name, `${s.name} (${s.num_examples})`])], { id: "sft-post-suite" });
    const scope = select([["held-out", "held-out (gates promotion)"], ["train-set-eval", "train-set-eval (report only)"]], { id: "sft-scope" });
    const minAcc = input({ id: "sft-min-acc", type: "number", step: "0.05", min: "0", max: "1", placeholder: "optional" });
    const out = h("div");
    const submit = h("button", { class: "primary", id: "sft-submit" }, "Start SFT");
    submit.onclick = () => act(submit, out, async () => {
      const config = { auto_load: autoLoad.checked };
      for (const [k, el] of Object.entries(cfg)) {
        const v = el.value.trim();
        if (v !== "") config[k] = k === "output_name" ? v : Number(v);
      }
      if (base.value) config.base_adapter = base.value;
      const body = { config };
      if (source.value === "examples") body.examples = parseRows(examples.value);
      else {
        if (!dataset.value) throw new ApiError(0, { message: "There is no dataset to train from.", hint: "Upload one on the Data page." });
        body.dataset = dataset.value;
        if (split.value !== "train") body.dataset_split = split.value;
      }
      if (suite.value) {
        body.post_eval = { suite: suite.value, data_scope: scope.value };
        if (minAcc.value) body.post_eval.min_accuracy = Number(minAcc.value);
      }
      const r = await post("/v1/train/sft", body);
      toast(r.message || `queued ${r.job_id}`);
      selected = r.job_id;
      ctx.go(`#/training?job=${q(r.job_id)}`);
    });
    return card("New SFT job", field("source", source), exBox, dsBox,
      h("div", { class: "grid3" }, ...Object.entries(cfg).map(([k, el]) => field(k, el))),
      h("div", { class: "grid2" }, field("continue from", base), h("label", { class: "check" }, autoLoad, " load the adapter when done")),
      details("Post-training eval gate", h("div", { class: "grid3" }, field("suite", suite), field("data scope", scope), field("min accuracy", minAcc))),
      submit, out);
  }

  async function refreshList() {
    let jobs;
    try { jobs = await get("/v1/train/status"); } catch (e) { clear(err, errorBox(e)); return; }
    clear(err);
    jobs.sort((a, b) => String(b.submitted_at).localeCompare(String(a.submitted_at)));
    if (!selected && jobs.length) selected = jobs[0].job_id;
    clear(jobsBox, table(["job", "state", "progress", "loss", "tok/s", "adapter", "gate"], jobs.map((j) =>
      h("tr", { class: `clickable ${j.job_id === selected ? "selected" : ""}`, "data-job": j.job_id,
        onclick: () => { selected = j.job_id; refreshList(); refreshDetail(); } },
        h("td", {}, h("code", {}, j.job_id.slice(0, 14)), h("div", { class: "muted small" }, `${j.job_type} · ${fmtTime(j.submitted_at)}`)),
        h("td", {}, stateBadge(j.state)),
        h("td", {}, progressBar(j.progress), h("span", { class: "small muted" }, `${j.step}/${j.total_steps}`)),
        h("td", {}, fmtNum(j.current_loss, 3)),
        h("td", {}, fmtNum(j.tokens_per_sec, 0)),
        h("td", {}, j.adapter_name || "—"),
        h("td", {}, j.gate_outcome ? stateBadge(j.gate_outcome) : h("span", { class: "muted" }, "—")))), { id: "train-jobs-table" }));
  }

  let lastDetail = null;
  async function refreshDetail() {
    if (!selected) { clear(detailBox); return; }
    if (lastDetail && lastDetail.job_id === selected && TERMINAL.includes(lastDetail.state) && lastDetail.gate_outcome !== "pending") return;
    let d;
    try { d = await get(`/v1/train/jobs/${q(selected)}`); } catch (e) { clear(detailBox, errorBox(e)); return; }
    lastDetail = d;
    const points = (d.loss_curve || []).filter((p) => Number.isFinite(p.loss)).map((p) => [p.step, p.loss]);
    const out = h("div");
    const terminal = TERMINAL.includes(d.state);
    const cancel = h("button", { class: terminal ? "danger" : "", id: "train-cancel", onclick: (e) => {
      if (terminal && !confirm(`Delete the record of job ${d.job_id}? The adapter stays.`)) return;
      act(e.currentTarget, out, async () => {
        const r = await del(`/v1/train/jobs/${q(d.job_id)}`);
        toast(r.message || r.status || "done");
        if (terminal) selected = null;
        lastDetail = null;
        refreshList(); refreshDetail();
      });
    } }, terminal ? "Delete record" : "Cancel job");
    const stat = (label, value) => h("div", { class: "stat" }, h("span", { class: "muted" }, label), h("strong", {}, value));
    clear(detailBox, card(`Job ${d.job_id}`,
      h("div", { class: "row wrap" }, stateBadge(d.state), d.cancel_requested ? stateBadge("cancelling") : null,
        d.gate_outcome ? [h("span", { class: "muted" }, "gate"), stateBadge(d.gate_outcome)] : null, h("span", { class: "spacer" }), cancel),
      h("div", { class: "stats" },
        stat("adapter", d.adapter_name || "—"), stat("step", `${d.step} / ${d.total_steps}`), stat("epoch", fmtNum(d.epoch, 2)),
        stat("loss", fmtNum(d.current_loss, 4)), stat("tokens/s", fmtNum(d.tokens_per_sec, 0)),
        stat("tokens trained", fmtNum(d.tokens_trained, 0)), stat("elapsed", fmtDuration(d.elapsed_secs)),
        stat("progress", fmtPct(d.progress, 0))),
      h("div", { id: "loss-curve" }, lineChart([{ name: "loss", points }], { id: "loss-chart", yMin: 0, xLabel: "step", yLabel: "loss", height: 240 })),
      d.job_type === "dpo" ? preferenceView(d, stat) : null,
      d.job_type === "opd" || d.job_type === "distill" ? distillView(d, stat) : null,
      d.error ? errorBox({ message: d.error }) : null,
      d.activation_error ? errorBox({ message: `activation: ${d.activation_error}` }) : null,
      d.post_eval_verdict ? h("p", { class: "verdict" }, d.post_eval_verdict) : null,
      (d.linked_eval_job_ids || []).length ? h("p", {}, "eval jobs: ", d.linked_eval_job_ids.map((id) => [h("a", { href: `#/evals?job=${q(id)}` }, id), " "])) : null,
      d.post_eval_gate_evidence ? details("gate evidence", json(d.post_eval_gate_evidence)) : null,
      details("config and data", json({ config: d.config, training_data: d.training_data, base_adapter: d.base_adapter, memory: d.memory })),
      d.train_receipt ? details("training receipt", json(d.train_receipt)) : null,
      out));
  }

  function preferenceView(d, stat) {
    const curve = (d.loss_curve || []).filter((p) => Number.isFinite(p.reward_margin));
    const series = [
      { name: "reward margin", points: curve.map((p) => [p.step, p.reward_margin]) },
      { name: "preference accuracy", points: curve.map((p) => [p.step, p.preference_accuracy]) }];
    const held = d.held_out;
    const data = d.training_data || {};
    return h("div", { id: "dpo-view" },
      h("div", { id: "reward-curve" }, lineChart(series, { id: "reward-chart", xLabel: "step", yLabel: "reward margin / accuracy", height: 200 })),
      h("p", { class: "muted small" }, `${data.train_pairs ?? "?"} training pairs, ${data.heldout_pairs ?? 0} held out`,
        data.judgments ? ` · from judgment set ${data.judgments} (${data.ties_left_out} tie, ${data.skips_left_out} skip left out)` : ""),
      held ? h("div", { class: "stats", id: "dpo-held-out" },
        stat("held-out pairs", fmtNum(held.pairs, 0)),
        stat("preference accuracy", `${fmtPct(held.preference_accuracy_before, 0)} → ${fmtPct(held.preference_accuracy_after, 0)}`),
        stat("log-prob margin", `${fmtNum(held.mean_logprob_margin_before, 2)} → ${fmtNum(held.mean_logprob_margin_after, 2)}`),
        stat("win rate vs start", fmtPct(held.win_rate_vs_start, 0))) : null);
  }

  ctx.every(1000, async () => { await refreshList(); await refreshDetail(); });
}
