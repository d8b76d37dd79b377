// A "target" is what a chat request generates with: the server default (the active adapter), the base
// model, one stored adapter, or a weighted composition of stored adapters (`adapters`).

import { get } from "./api.js";
import { h, input, select } from "./dom.js";

export async function adapterNames() {
  try {
    const list = await get("/v1/adapters");
    return { active: list.active || null, names: (list.available || []).map((a) => a.name) };
  } catch {
    return { active: null, names: [] };
  }
}

// The request fields for a target: {} (server default), {adapter: null} (base), {adapter: name}, or
// {adapters: [{name, scale}]}.
export function targetFields(t) {
  if (t.kind === "default") return {};
  if (t.kind === "base") return { adapter: null };
  if (t.kind === "adapter") return { adapter: t.name };
  return { adapters: t.parts.map((p) => ({ name: p.name, scale: p.scale })) };
}

// The label stored in a judgment row (adapter_a / adapter_b): null for the base model.
export function targetLabel(t, active) {
  if (t.kind === "default") return active || null;
  if (t.kind === "base") return null;
  if (t.kind === "adapter") return t.name;
  return t.parts.map((p) => `${p.name}*${p.scale}`).join("+");
}

export function describeTarget(t, active) {
  if (t.kind === "default") return active ? `default (${active})` : "default (base)";
  if (t.kind === "composition") return t.parts.map((p) => `${p.name} × ${p.scale}`).join(" + ") || "composition";
  return t.kind === "base" ? "base model" : t.name;
}

// A picker widget; .value() gives the current target.
export function targetPicker(names, { id, initial = "default" } = {}) {
  const optionsFor = (list) => {
    const options = [["default", "server default (active adapter)"], ["base", "base model"],
      ...list.map((n) => [`adapter:${n}`, `adapter: ${n}`])];
    if (list.length) options.push(["composition", "composition of adapters…"]);
    return options;
  };
  const sel = select(optionsFor(names), { id, class: "target-select" });
  sel.value = initial;
  const parts = h("div", { class: "composition" });
  const addPart = (name = names[0], scale = 1) => {
    const row = h("div", { class: "row compact comp-part" },
      select(names, { class: "comp-name", value: name }),
      input({ type: "number", step: "0.1", class: "comp-scale", value: String(scale), "aria-label": "scale" }),
      h("button", { type: "button", class: "small", onclick: () => row.remove(), title: "remove" }, "×"));
    row.querySelector(".comp-name").value = name;
    parts.insertBefore(row, addButton);
  };
  const addButton = h("button", { type: "button", class: "small", onclick: () => addPart() }, "+ adapter");
  parts.append(addButton);
  const sync = () => {
    parts.hidden = sel.value !== "composition";
    if (!parts.hidden && !parts.querySelector(".comp-part")) { addPart(names[0], 0.5); addPart(names[1] || names[0], 0.5); }
  };
  sel.addEventListener("change", sync);
  sync();
  const wrap = h("div", { class: "target-picker" }, sel, parts);
  // Adapters trained or uploaded while the page is open join the list; the choice is kept.
  wrap.setNames = (list) => {
    if (list.join("\n") === names.join("\n")) return;
    names = list;
    const keep = sel.value;
    sel.replaceChildren(...select(optionsFor(list)).children);
    sel.value = [...sel.options].some((o) => o.value === keep) ? keep : "default";
    for (const nameSel of parts.querySelectorAll(".comp-name")) {
      const v = nameSel.value;
      nameSel.replaceChildren(...select(list).children);
      nameSel.value = list.includes(v) ? v : list[0] || "";
    }
    sync();
  };
  wrap.value = () => {
    const v = sel.value;
    if (v === "default" || v === "base") return { kind: v };
    if (v.startsWith("adapter:")) return { kind: "adapter", name: v.slice(8) };
    return { kind: "composition", parts: [...parts.querySelectorAll(".comp-part")].map((r) => ({
      name: r.querySelector(".comp-name").value, scale: Number(r.querySelector(".comp-scale").value) })) };
  };
  return wrap;
}
