// Playground: streaming chat against any target, a side-by-side compare whose vote appends a row to
// a judgment set, and "correct this answer", which stores a correction (POST /v1/corrections) or,
// on a server without corrections, keeps SFT examples in this browser, and can start training.

import { ApiError, get, hasRoute, post, q, streamChat } from "./api.js";
import { act, card, clear, details, errorBox, field, fmtNum, h, input, json, select, toast } from "./dom.js";
import { adapterNames, describeTarget, targetFields, targetLabel, targetPicker } from "./targets.js";

const LOCAL_EXAMPLES = "kiln.pendingExamples";
const state = { messages: [], mode: "chat" }; // survives page switches within one visit

function localExamples() {
  try { return JSON.parse(localStorage.getItem(LOCAL_EXAMPLES) || "[]"); } catch { return []; }
}
function saveLocalExamples(rows) {
  try { localStorage.setItem(LOCAL_EXAMPLES, JSON.stringify(rows)); } catch { /* ignore */ }
}

function num(el) {
  const v = el.value.trim();
  return v === "" ? undefined : Number(v);
}

// ---- one streamed answer ---------------------------------------------------------------------------

// A view of one assistant turn that fills in while its stream arrives.
function answerView(title) {
  const reasoning = h("pre", { class: "reasoning-text" });
  const reasoningBox = h("details", { class: "reasoning", hidden: true, open: true }, h("summary", {}, "Reasoning"), reasoning);
  const content = h("div", { class: "content" });
  const tools = h("div", { class: "tool-calls" });
  const parsed = h("div", { class: "parsed-value" });
  const meta = h("div", { class: "answer-meta" });
  const actions = h("div", { class: "answer-actions" });
  const error = h("div");
  const el = h("div", { class: "msg assistant" }, title ? h("div", { class: "msg-title" }, title) : null,
    reasoningBox, content, tools, parsed, error, meta, actions);
  return { el, reasoning, reasoningBox, content, tools, parsed, meta, actions, error };
}

function mergeToolCalls(into, deltas) {
  for (const d of deltas) {
    const i = d.index ?? into.length;
    const cur = (into[i] ||= { id: d.id, type: d.type || "function", function: { name: "", arguments: "" } });
    if (d.id) cur.id = d.id;
    if (d.function?.name) cur.function.name += d.function.name;
    if (d.function?.arguments) cur.function.arguments += typeof d.function.arguments === "string" ? d.function.arguments : JSON.stringify(d.function.arguments);
  }
}

function outcomeText(tb) {
  if (!tb) return null;
  if (!tb.configured) return null;
  if (tb.applied === false) return "budget inert";
  if (!("closed" in tb)) return "budget unresolved";
  const limit = { tokens: "thinking-token budget", time: "thinking-time budget", max_tokens: "max_tokens" }[tb.trigger] || tb.trigger;
  if (tb.triggered) return `thinking ${tb.closed ? "forced closed" : "cut off"} by the ${limit} after ${tb.thinking_tokens} tokens, ${tb.thinking_time_ms} ms`;
  return `thinking closed by itself after ${tb.thinking_tokens} tokens`;
}

async function runStream(body, view, signal) {
  const out = { id: null, content: "", reasoning: "", toolCalls: [], finish: null, metadata: null, usage: null };
  view.el.classList.add("streaming");
  let chunks = 0;
  try {
    await streamChat(body, (chunk) => {
      view.el.dataset.chunks = String(++chunks);
      if (chunk.id) out.id = chunk.id;
      if (chunk.usage) out.usage = chunk.usage;
      if (chunk.metadata) out.metadata = chunk.metadata;
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if (d.reasoning_content) {
          out.reasoning += d.reasoning_content;
          view.reasoningBox.hidden = false;
          view.reasoning.textContent = out.reasoning;
        }
        if (d.content) {
          out.content += d.content;
          view.content.textContent = out.content;
        }
        if (d.tool_calls) {
          mergeToolCalls(out.toolCalls, d.tool_calls);
          clear(view.tools, out.toolCalls.map((tc) => h("div", { class: "tool-call" },
            h("span", { class: "tool-name" }, `tool call: ${tc.function.name || "?"}`), h("code", {}, tc.function.arguments))));
        }
        if (choice.finish_reason) out.finish = choice.finish_reason;
      }
    }, signal);
  } catch (err) {
    if (err.name !== "AbortError") clear(view.error, errorBox(err));
    else out.finish = out.finish || "stopped";
  } finally {
    view.el.classList.remove("streaming");
  }
  const perf = out.metadata?.performance;
  const bits = [out.finish && `finish: ${out.finish}`,
    out.usage && `${out.usage.completion_tokens} tokens`,
    perf?.decode_tokens_per_sec && `${fmtNum(perf.decode_tokens_per_sec)} tok/s`,
    perf?.ttft_ms !== undefined && perf?.ttft_ms !== null && `TTFT ${fmtNum(perf.ttft_ms, 0)} ms`,
    perf?.adapter_used && `adapter: ${perf.adapter_used}`,
    outcomeText(out.metadata?.thinking_budget)].filter(Boolean);
  clear(view.meta, bits.join(" · "));
  if (!out.content && !out.toolCalls.length && !view.error.childNodes.length) view.content.append(h("span", { class: "muted" }, "(no content)"));
  if (body.response_format && out.content) {
    // the server held the answer to the schema: show the value it parses to
    let shown;
    try { shown = h("pre", {}, JSON.stringify(JSON.parse(out.content), null, 2)); } catch {
      shown = h("span", { class: "muted" }, `not complete JSON (finish: ${out.finish})`);
    }
    clear(view.parsed, h("div", { class: "msg-title" }, "parsed value"), shown);
  }
  view.el.dataset.done = "true";
  return out;
}

// ---- controls ---------------------------------------------------------------------------------------

function controls() {
  const el = {
    system: h("textarea", { id: "pg-system", rows: 2, placeholder: "optional system prompt" }),
    temperature: input({ id: "pg-temperature", type: "number", step: "0.1", min: "0", value: "0.7" }),
    top_p: input({ id: "pg-top-p", type: "number", step: "0.05", min: "0", max: "1", placeholder: "default" }),
    top_k: input({ id: "pg-top-k", type: "number", min: "0", placeholder: "default" }),
    max_tokens: input({ id: "pg-max-tokens", type: "number", min: "1", value: "256" }),
    seed: input({ id: "pg-seed", type: "number", min: "0", placeholder: "random" }),
    stop: input({ id: "pg-stop", placeholder: "comma-separated" }),
    thinking: select([["", "template default"], ["on", "on"], ["off", "off"]], { id: "pg-thinking" }),
    budgetTokens: input({ id: "pg-budget-tokens", type: "number", min: "0", placeholder: "default" }),
    budgetMs: input({ id: "pg-budget-ms", type: "number", min: "0", placeholder: "default" }),
    schema: h("textarea", { id: "pg-schema", rows: 4, placeholder: '{"type":"object","properties":{"answer":{"type":"string"}},"required":["answer"]}' }),
    tools: h("textarea", { id: "pg-tools", rows: 4, placeholder: '[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]' }),
  };
  el.body = () => {
    const b = { include_performance: true, stream_options: { include_usage: true } };
    const put = (k, v) => { if (v !== undefined && !Number.isNaN(v)) b[k] = v; };
    put("temperature", num(el.temperature));
    put("top_p", num(el.top_p));
    put("top_k", num(el.top_k));
    put("max_tokens", num(el.max_tokens));
    put("seed", num(el.seed));
    const stop = el.stop.value.split(",").map((x) => x.trim()).filter(Boolean);
    if (stop.length) b.stop = stop;
    if (el.thinking.value) b.chat_template_kwargs = { enable_thinking: el.thinking.value === "on" };
    put("thinking_budget_tokens", num(el.budgetTokens));
    put("thinking_budget_ms", num(el.budgetMs));
    if (el.tools.value.trim()) {
      try { b.tools = JSON.parse(el.tools.value); } catch (e) {
        throw new ApiError(0, { message: `Tools are not valid JSON: ${e.message}`, hint: "Give an OpenAI tools array." });
      }
    }
    if (el.schema.value.trim()) {
      let schema;
      try { schema = JSON.parse(el.schema.value); } catch (e) {
        throw new ApiError(0, { message: `The output schema is not valid JSON: ${e.message}`, hint: "Give a JSON Schema object." });
      }
      b.response_format = { type: "json_schema", json_schema: { name: "output", schema, strict: true } };
    }
    return b;
  };
  el.panel = h("div", { class: "controls" },
    field("System prompt", el.system),
    h("div", { class: "grid2" },
      field("temperature", el.temperature), field("max_tokens", el.max_tokens),
      field("top_p", el.top_p), field("top_k", el.top_k),
      field("seed", el.seed), field("stop", el.stop)),
    field("thinking", el.thinking),
    h("div", { class: "grid2" }, field("thinking budget, tokens", el.budgetTokens), field("thinking budget, ms", el.budgetMs)),
    details("Output JSON schema (response_format)", el.schema),
    details("Tools (JSON)", el.tools));
  return el;
}

// ---- corrections ------------------------------------------------------------------------------------

async function correctionsPanel(box, useRoute) {
  clear(box);
  const out = h("div");
  const outputName = input({ id: "corr-output", placeholder: "adapter name (generated if empty)" });
  const epochs = input({ id: "corr-epochs", type: "number", min: "1", placeholder: "default" });
  const lr = input({ id: "corr-lr", type: "number", step: "any", placeholder: "default" });
  const config = () => {
    const c = { auto_load: true };
    if (outputName.value.trim()) c.output_name = outputName.value.trim();
    if (epochs.value) c.epochs = Number(epochs.value);
    if (lr.value) c.learning_rate = Number(lr.value);
    return c;
  };
  const trainButton = h("button", { class: "primary", id: "corr-train" }, "Train on corrections");
  const form = h("div", {}, h("div", { class: "grid3" }, field("output adapter", outputName), field("epochs", epochs),
    field("learning rate", lr)), h("div", { class: "row" }, trainButton));
  if (useRoute) {
    let list = [];
    try { const r = await get("/v1/corrections"); list = r.corrections || r.data || (Array.isArray(r) ? r : []); } catch (e) { out.append(errorBox(e)); }
    const pending = list.filter((c) => (c.state || "pending") === "pending");
    box.append(h("p", {}, `${pending.length} pending correction(s) on the server (`, h("code", {}, "GET /v1/corrections"), `), ${list.length - pending.length} trained.`));
    trainButton.disabled = !pending.length;
    trainButton.onclick = () => act(trainButton, out, async () => {
      const r = await post("/v1/corrections/train", { config: config() });
      clear(out, h("p", {}, "Training job ", h("a", { href: `#/training?job=${q(r.job_id)}`, id: "corr-job-link" }, r.job_id), " queued."));
    });
  } else {
    const rows = localExamples();
    box.append(h("p", {}, `${rows.length} correction(s) kept in this browser as SFT examples (this server has no /v1/corrections).`));
    if (rows.length) box.append(details("examples", json(rows)));
    trainButton.disabled = !rows.length;
    trainButton.onclick = () => act(trainButton, out, async () => {
      const r = await post("/v1/train/sft", { examples: rows, config: config() });
      saveLocalExamples([]);
      await correctionsPanel(box, useRoute);
      box.append(h("p", {}, "Training job ", h("a", { href: `#/training?job=${q(r.job_id)}`, id: "corr-job-link" }, r.job_id), " queued: ", r.message));
    });
    const clearButton = h("button", { onclick: () => { saveLocalExamples([]); correctionsPanel(box, useRoute); } }, "Discard");
    if (rows.length) form.lastChild.append(clearButton);
  }
  box.append(form, out);
}

function correctionEditor(answer, prompt, onSaved, useRoute) {
  const text = h("textarea", { class: "corr-text", rows: 4 }, answer.content);
  const note = input({ class: "corr-note", placeholder: "note (optional)" });
  const out = h("div");
  const save = h("button", { class: "primary corr-save" }, "Save correction");
  const editor = h("div", { class: "correction-editor" }, field("Corrected answer", text), field("Note", note),
    h("div", { class: "row" }, save, h("button", { onclick: () => editor.remove() }, "Cancel")), out);
  save.onclick = () => act(save, out, async () => {
    const corrected = { role: "assistant", content: text.value };
    if (useRoute) {
      const body = { corrected, ...(note.value ? { note: note.value } : {}) };
      try {
        await post("/v1/corrections", { ...body, request_id: answer.id });
      } catch (err) {
        // the recent-request ring may have dropped it: send the conversation itself
        if (err.status !== 404 && err.status !== 400) throw err;
        await post("/v1/corrections", { ...body, messages: prompt });
      }
    } else {
      saveLocalExamples([...localExamples(), { messages: [...prompt, corrected] }]);
    }
    editor.replaceWith(h("div", { class: "ok-note" }, "✓ correction saved"));
    onSaved();
  });
  return editor;
}

// ---- page -------------------------------------------------------------------------------------------

export async function render(root, ctx) {
  let [{ active, names }, correctionsRoute, judgmentsList] = await Promise.all([
    adapterNames(), hasRoute("/v1/corrections"), get("/v1/judgments").catch(() => ({ judgments: [] }))]);
  const c = controls();
  const pickA = targetPicker(names, { id: "target-a" });
  const pickB = targetPicker(names, { id: "target-b", initial: names.length ? `adapter:${names[0]}` : "base" });
  const modeChat = h("button", { class: "tab", id: "mode-chat" }, "Chat");
  const modeCompare = h("button", { class: "tab", id: "mode-compare" }, "Compare A / B");
  const bField = field("Target B", pickB);
  const transcript = h("div", { class: "transcript", id: "transcript" });
  const prompt = h("textarea", { id: "pg-input", rows: 3, placeholder: "Message… (Ctrl+Enter sends)" });
  const send = h("button", { class: "primary", id: "pg-send" }, "Send");
  const stop = h("button", { id: "pg-stop-btn", disabled: true }, "Stop");
  const clearBtn = h("button", { id: "pg-clear" }, "New chat");
  const corrBox = h("div", { id: "corrections-panel" });
  let controller = null;

  const setMode = (mode) => {
    state.mode = mode;
    modeChat.classList.toggle("active", mode === "chat");
    modeCompare.classList.toggle("active", mode === "compare");
    bField.hidden = mode !== "compare";
    clear(transcript);
    if (mode === "chat") state.messages.forEach((m) => transcript.append(staticMessage(m)));
  };
  modeChat.onclick = () => setMode("chat");
  modeCompare.onclick = () => setMode("compare");

  const staticMessage = (m) => {
    if (m.role === "user") return h("div", { class: "msg user" }, m.content);
    const v = answerView();
    if (m.reasoning_content) { v.reasoningBox.hidden = false; v.reasoningBox.open = false; v.reasoning.textContent = m.reasoning_content; }
    v.content.textContent = m.content || "";
    return v.el;
  };

  const baseMessages = () => (c.system.value.trim() ? [{ role: "system", content: c.system.value.trim() }] : []);

  const addCorrectAction = (view, answer, promptMessages) => {
    const b = h("button", { class: "small corr-open" }, "✎ Correct this answer");
    b.onclick = () => view.el.append(correctionEditor(answer, promptMessages, () => correctionsPanel(corrBox, correctionsRoute), correctionsRoute));
    view.actions.append(b);
  };

  async function sendChat(text) {
    const userMsg = { role: "user", content: text };
    const history = [...state.messages, userMsg];
    state.messages.push(userMsg);
    transcript.append(h("div", { class: "msg user" }, text));
    const view = answerView(describeTarget(pickA.value(), active));
    transcript.append(view.el);
    const promptMessages = [...baseMessages(), ...history];
    const body = { ...c.body(), ...targetFields(pickA.value()), messages: promptMessages };
    const answer = await runStream(body, view, controller.signal);
    const assistant = { role: "assistant", content: answer.content };
    if (answer.toolCalls.length) assistant.tool_calls = answer.toolCalls;
    if (answer.reasoning) assistant.reasoning_content = answer.reasoning;
    state.messages.push(assistant);
    if (answer.content || answer.toolCalls.length) addCorrectAction(view, answer, promptMessages);
    transcript.scrollTop = transcript.scrollHeight;
  }

  async function sendCompare(text) {
    clear(transcript);
    const promptMessages = [...baseMessages(), { role: "user", content: text }];
    const ta = pickA.value(), tb = pickB.value();
    const va = answerView(`A · ${describeTarget(ta, active)}`), vb = answerView(`B · ${describeTarget(tb, active)}`);
    va.el.id = "answer-a"; vb.el.id = "answer-b";
    transcript.append(h("div", { class: "msg user" }, text), h("div", { class: "compare" }, va.el, vb.el));
    const common = c.body();
    const [a, b] = await Promise.all([
      runStream({ ...common, ...targetFields(ta), messages: promptMessages }, va, controller.signal),
      runStream({ ...common, ...targetFields(tb), messages: promptMessages }, vb, controller.signal)]);
    for (const [v, ans] of [[va, a], [vb, b]]) if (ans.content) addCorrectAction(v, ans, promptMessages);
    transcript.append(voteBar(promptMessages, { target: ta, answer: a }, { target: tb, answer: b }));
  }

  function voteBar(promptMessages, A, B) {
    const sets = judgmentsList.judgments || [];
    const setSelect = select([...sets.map((j) => [j.name, `${j.name} (${j.num_rows} rows)`]), ["__new__", "new set…"]], { id: "judgment-set" });
    const stored = localStorage.getItem("kiln.judgmentSet");
    if (stored && sets.some((j) => j.name === stored)) setSelect.value = stored;
    const newName = input({ id: "judgment-new-name", placeholder: "new judgment set name", value: "playground" });
    const syncNew = () => { newName.hidden = setSelect.value !== "__new__"; };
    setSelect.onchange = syncNew;
    syncNew();
    const out = h("div", { id: "vote-result" });
    const vote = (winner) => async (e) => act(e.currentTarget, out, async () => {
      let name = setSelect.value;
      if (name === "__new__") {
        name = newName.value.trim();
        const exists = (await get("/v1/judgments")).judgments.some((j) => j.name === name);
        if (!exists) await post("/v1/judgments", { name, description: "pairwise votes from the dashboard playground" });
      }
      const row = await post(`/v1/judgments/${q(name)}/rows`, {
        prompt: promptMessages, adapter_a: targetLabel(A.target, active), adapter_b: targetLabel(B.target, active),
        response_a: A.answer.content, response_b: B.answer.content, winner, tags: ["dashboard"] });
      localStorage.setItem("kiln.judgmentSet", name);
      bar.querySelectorAll("button.vote").forEach((b) => { b.disabled = true; });
      clear(out, h("span", { class: "ok-note" }, `✓ saved "${winner}" to `, h("a", { href: `#/data?judgment=${q(name)}` }, name),
        ` (row ${row.judgment_id}, ${row.num_rows} rows now)`));
    });
    const bar = h("div", { class: "vote-bar" },
      h("span", {}, "Which is better?"),
      h("button", { class: "vote", id: "vote-a", onclick: vote("a") }, "A better"),
      h("button", { class: "vote", id: "vote-b", onclick: vote("b") }, "B better"),
      h("button", { class: "vote", id: "vote-tie", onclick: vote("tie") }, "Tie"),
      h("button", { class: "vote", id: "vote-skip", onclick: vote("skip") }, "Skip"),
      h("span", { class: "row compact" }, "into", setSelect, newName), out);
    if (!A.answer.content || !B.answer.content) bar.prepend(h("div", { class: "muted" }, "One side has no content; a vote records it as empty."));
    return bar;
  }

  const doSend = async () => {
    const text = prompt.value.trim();
    if (!text || controller) return;
    prompt.value = "";
    controller = new AbortController();
    send.disabled = true; stop.disabled = false;
    try {
      if (state.mode === "compare") await sendCompare(text); else await sendChat(text);
    } catch (err) {
      transcript.append(errorBox(err));
    } finally {
      controller = null;
      send.disabled = false; stop.disabled = true;
    }
  };
  send.onclick = doSend;
  stop.onclick = () => controller && controller.abort();
  clearBtn.onclick = () => { state.messages = []; clear(transcript); };
  prompt.addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); doSend(); } });

  root.append(h("div", { class: "playground" },
    h("aside", { class: "side" },
      card("Target", field("Target A", pickA), bField, c.panel)),
    h("div", { class: "main-col" },
      h("div", { class: "tabs" }, modeChat, modeCompare),
      card(null, transcript,
        h("div", { class: "composer" }, prompt, h("div", { class: "row" }, send, stop, clearBtn)))),
    h("div", { class: "corr-col" }, card("Corrections", corrBox))));
  setMode(state.mode);
  await correctionsPanel(corrBox, correctionsRoute);
  ctx.every(4000, async () => {
    const list = await get("/v1/adapters"); // a failed poll throws and changes nothing
    active = list.active || null;
    names = (list.available || []).map((a) => a.name);
    pickA.setNames(names);
    pickB.setNames(names);
  });
}
