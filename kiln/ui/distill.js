// Distillation on the training page: the forms for an OPD job (learn from a registered teacher) and a
// self-distillation job (the same model with privileged context as its own teacher), and a distillation
// job's view (KL to the teacher per step, then its before/after KL over the training completions).

import { ApiError, get, post } from "./api.js";
import { lineChart } from "./charts.js";
import { act, card, configFields, details, field, fmtNum, h, readConfig, select, toast } from "./dom.js";

const SAMPLE_PROMPTS = ["What is the capital of Zorbania?", "Name Zorbania's capital."].join("\n");

// One prompt per line: plain text is one user message; a line starting with { or [ is a JSON row
// ({"messages": [...]}, {"prompt": ...}, optionally with "reference").
export function parsePrompts(text) {
  return text.split("\n").map((l) => l.trim()).filter((l) => l).map((line, i) => {
    if (!line.startsWith("{") && !line.startsWith("[")) return line;
    try { return JSON.parse(line); } catch (e) {
      throw new ApiError(0, { message: `Line ${i + 1} is not JSON: ${e.message}`, hint: "Plain text, or one JSON row per line." });
    }
  });
}

function common(prefix) {
  return configFields(prefix, {
    output_name: ["output", "", { placeholder: "generated if empty" }],
    epochs: ["epochs", "3", { type: "number", min: "1" }],
    learning_rate: ["lr", "0.0002", { type: "number", step: "any" }],
    max_new_tokens: ["max-new", "64", { type: "number", min: "1" }],
    samples_per_prompt: ["samples", "1", { type: "number", min: "1", max: "16" }],
    lora_rank: ["rank", "16", { type: "number", min: "1" }],
  });
}

// The OPD and self-distillation forms; `onQueued(job_id)` follows the new job.
export async function distillCard(onQueued) {
  const [teachers, adapters] = await Promise.all([
    get("/v1/teachers").then((r) => r.teachers || []).catch(() => []),
    get("/v1/adapters").then((r) => r.available || []).catch(() => [])]);
  const adapterOptions = (none) => select([["", none], ...adapters.map((a) => a.name)]);

  // --- OPD from a registered teacher
  const teacher = select(teachers.map((t) => [t.alias, `${t.alias} (${t.kind}${t.adapter ? `, ${t.adapter}` : ""}${t.url ? `, ${t.url}` : ""})`]), { id: "opd-teacher" });
  const mode = select([["on_policy", "on-policy (the student writes, the teacher scores)"], ["off_policy", "off-policy (the teacher writes)"]], { id: "opd-mode" });
  const objective = select([["", "default (reverse KL on-policy, forward KL off-policy)"], ["reverse_kl", "reverse KL (mode-seeking)"],
    ["forward_kl", "forward KL (mass-covering)"], ["jsd", "Jensen-Shannon"]], { id: "opd-objective" });
  const topK = select(["16", "32"], { id: "opd-top-k" });
  const opdPrompts = h("textarea", { id: "opd-prompts", rows: 4 }, SAMPLE_PROMPTS);
  const opdCfg = common("opd");
  const opdBase = adapterOptions("none (the base model)");
  opdBase.id = "opd-base";
  const opdAuto = h("input", { type: "checkbox", id: "opd-autoload", checked: true });
  const opdOut = h("div");
  const opdSubmit = h("button", { class: "primary", id: "opd-submit" }, "Start OPD");
  opdSubmit.onclick = () => act(opdSubmit, opdOut, async () => {
    if (!teacher.value) throw new ApiError(0, { message: "There is no registered teacher.", hint: "Register one with POST /v1/teachers or `kiln teachers add`." });
    const config = { ...readConfig(opdCfg), training_mode: mode.value, top_k: Number(topK.value), auto_load: opdAuto.checked };
    if (objective.value) config.objective = objective.value;
    if (opdBase.value) config.base_adapter = opdBase.value;
    const r = await post("/v1/train/opd", { prompts: parsePrompts(opdPrompts.value), teacher: teacher.value, config });
    toast(r.message || `queued ${r.job_id}`);
    onQueued(r.job_id);
  });
  const opd = details("New OPD job (learn from a teacher)",
    h("div", { class: "grid3" }, field("teacher", teacher), field("mode", mode), field("objective", objective)),
    field("prompts", opdPrompts, 'one per line: plain text, or a JSON row {"messages": [...]}'),
    h("div", { class: "grid3" }, ...Object.values(opdCfg).map(([label, el]) => field(label, el)), field("top-K", topK)),
    h("div", { class: "grid2" }, field("student starts from", opdBase), h("label", { class: "check" }, opdAuto, " load the adapter when done")),
    opdSubmit, opdOut);
  opd.id = "opd-card";

  // --- self-distillation
  const selfMode = select([["conciseness", "conciseness (the teacher is told to be brief)"], ["ground_truth_conditioning", "ground truth (the teacher sees the reference answer)"]], { id: "self-mode" });
  const instruction = h("textarea", { id: "self-instruction", rows: 2, placeholder: "optional: replaces the mode's instruction ({reference} is substituted)" });
  const selfPrompts = h("textarea", { id: "self-prompts", rows: 4 }, SAMPLE_PROMPTS);
  const selfCfg = common("self");
  const selfBase = adapterOptions("none (the base model)");
  selfBase.id = "self-base";
  const selfAuto = h("input", { type: "checkbox", id: "self-autoload", checked: true });
  const selfOut = h("div");
  const selfSubmit = h("button", { class: "primary", id: "self-submit" }, "Start self-distillation");
  selfSubmit.onclick = () => act(selfSubmit, selfOut, async () => {
    const config = { ...readConfig(selfCfg), auto_load: selfAuto.checked };
    if (selfBase.value) config.base_adapter = selfBase.value;
    const body = { prompts: parsePrompts(selfPrompts.value), mode: selfMode.value, config };
    if (instruction.value.trim()) body.instruction = instruction.value.trim();
    const r = await post("/v1/distill/self", body);
    toast(r.message || `queued ${r.job_id}`);
    onQueued(r.job_id);
  });
  const self = details("New self-distillation job (the model teaches itself)", field("mode", selfMode), field("instruction", instruction),
    field("prompts", selfPrompts, 'one per line; ground truth needs a reference: {"messages": [user, assistant]} or {"prompt": ..., "reference": ...}'),
    h("div", { class: "grid3" }, ...Object.values(selfCfg).map(([label, el]) => field(label, el))),
    h("div", { class: "grid2" }, field("start from", selfBase), h("label", { class: "check" }, selfAuto, " load the adapter when done")),
    selfSubmit, selfOut);
  self.id = "self-card";
  return card("Distillation", opd, self);
}

// A distillation job's KL to its teacher per step and its held-out (training completions) result.
export function distillView(d, stat) {
  const curve = (d.loss_curve || []).filter((p) => Number.isFinite(p.kl_to_teacher));
  const held = d.held_out;
  const data = d.training_data || {};
  return h("div", { id: "distill-view" },
    h("div", { id: "kl-curve" }, lineChart([{ name: "KL to teacher", points: curve.map((p) => [p.step, p.kl_to_teacher]) }],
      { id: "kl-chart", yMin: 0, xLabel: "step", yLabel: "KL to teacher", height: 200 })),
    h("p", { class: "muted small" }, `${data.completions ?? "?"} completions of ${data.prompts ?? "?"} prompts`,
      data.teacher ? ` · teacher ${data.teacher}` : "", data.self_distill_mode ? ` · self-distillation (${data.self_distill_mode})` : "",
      data.mode ? ` · ${data.mode}` : ""),
    held ? h("div", { class: "stats", id: "distill-held-out" },
      stat("KL to teacher", `${fmtNum(held.kl_to_teacher_before, 4)} → ${fmtNum(held.kl_to_teacher_after, 4)}`),
      stat("completions", fmtNum(held.completions, 0)),
      stat("mean completion tokens", fmtNum(held.mean_completion_tokens, 1)),
      stat("teacher cache hits", fmtNum(held.teacher_cache_hits, 0))) : null);
}
