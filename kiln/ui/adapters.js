// Adapters: the PEFT store (GET /v1/adapters) with size, revision (content hash) and parent; load,
// unload, upload (tar.gz), download, merge, delete; details on demand.

import { ApiError, del, get, post, q, request } from "./api.js";
import { act, badge, card, clear, details, errorBox, field, fmtBytes, fmtTime, h, input, json, saveBlob, select, shortHash, table, toast } from "./dom.js";

function parentOf(info) {
  const lineage = info.manifest?.lineage || {};
  if (lineage.merge) {
    const srcs = lineage.merge.sources || [];
    return `${lineage.merge.mode || "merge"} of ${srcs.map((s) => `${s.name}×${s.weight}`).join(", ") || "adapters"}`;
  }
  if (lineage.parent_adapter) return lineage.parent_adapter;
  return lineage.training_data_source ? `trained from ${lineage.training_data_source} data` : null;
}

export async function render(root) {
  const listBox = h("div", { id: "adapter-list" });
  const err = h("div");
  const detailBox = h("div", { id: "adapter-detail" });
  root.append(err, card("Adapters", listBox, detailBox), h("div", { class: "cols" }, uploadCard(), mergeCard()));

  async function refresh() {
    let list;
    try { list = await get("/v1/adapters"); } catch (e) { clear(err, errorBox(e)); return; }
    clear(err);
    const rows = (list.available || []).map((a) => {
      const isActive = a.name === list.active;
      const out = h("div");
      const loadBtn = isActive
        ? h("button", { class: "small", onclick: (e) => act(e.currentTarget, null, async () => { await post("/v1/adapters/unload", {}); toast("Unloaded: the base model is the default again"); refresh(); }) }, "Unload")
        : h("button", { class: "small", onclick: (e) => act(e.currentTarget, null, async () => { await post("/v1/adapters/load", { name: a.name }); toast(`Loaded ${a.name}`); refresh(); }) }, "Load");
      const download = h("button", { class: "small", onclick: (e) => act(e.currentTarget, null, async () => {
        const resp = await request("GET", `/v1/adapters/${q(a.name)}/download`, { raw: true });
        saveBlob(await resp.blob(), `${a.name}.tar.gz`);
      }) }, "Download");
      const remove = h("button", { class: "small danger", onclick: (e) => {
        if (!confirm(`Delete adapter ${a.name}? Its files are removed from the adapter directory.`)) return;
        act(e.currentTarget, null, async () => { await del(`/v1/adapters/${q(a.name)}`); toast(`Deleted ${a.name}`); refresh(); });
      } }, "Delete");
      const info = h("button", { class: "small", onclick: (e) => act(e.currentTarget, detailBox, async () => {
        const d = await get(`/v1/adapters/${q(a.name)}/detail`);
        clear(detailBox, card(`Adapter ${a.name}`,
          h("p", {}, `rank ${d.rank ?? "?"} · alpha ${d.lora_alpha ?? "?"} · ${d.num_layers ?? "?"} layers · ${d.num_tensors ?? "?"} tensors · ${d.dtype ?? ""}`),
          d.target_modules ? h("p", {}, `modules: ${[].concat(d.target_modules).join(", ")}`) : null,
          d.compatibility ? h("p", {}, d.compatibility.compatible ? badge("compatible with the served model", "good") : badge(`incompatible: ${d.compatibility.error || ""}`, "bad")) : null,
          d.layout_error ? errorBox({ message: d.layout_error }) : null,
          details("manifest and config", json({ manifest: d.manifest, config: d.config }))));
      }) }, "Details");
      return h("tr", { "data-adapter": a.name, class: isActive ? "active-row" : "" },
        h("td", {}, h("strong", {}, a.name), isActive ? [" ", badge("active", "good")] : null,
          a.adapter_manifest_error ? h("div", { class: "error-hint" }, a.adapter_manifest_error) : null),
        h("td", {}, fmtBytes(a.size_bytes)),
        h("td", { title: a.content_sha256 || "" }, h("code", {}, shortHash(a.content_sha256))),
        h("td", {}, parentOf(a) || h("span", { class: "muted" }, "—")),
        h("td", {}, fmtTime(a.modified_at)),
        h("td", { class: "actions" }, loadBtn, info, download, remove, out));
    });
    clear(listBox,
      h("p", { class: "muted" }, list.active ? ["Requests without an adapter field use ", h("strong", {}, list.active), "."] : "No adapter is active: requests use the base model."),
      table(["name", "size", "revision", "parent", "modified", ""], rows, { id: "adapters-table" }));
  }

  function uploadCard() {
    const name = input({ id: "upload-name", placeholder: "adapter name" });
    const file = h("input", { type: "file", id: "upload-file", accept: ".tar.gz,.tgz,application/gzip" });
    const out = h("div");
    const button = h("button", { class: "primary", id: "upload-submit" }, "Upload");
    file.onchange = () => {
      if (!name.value && file.files[0]) name.value = file.files[0].name.replace(/\.(tar\.gz|tgz)$/, "");
    };
    button.onclick = () => act(button, out, async () => {
      if (!file.files[0]) throw new ApiError(0, { message: "Choose a .tar.gz archive first.", hint: "A PEFT adapter folder packed with tar czf." });
      const form = new FormData();
      form.append("name", name.value.trim());
      form.append("archive", file.files[0]);
      const r = await request("POST", "/v1/adapters/upload", { form });
      clear(out, h("div", { class: "ok-note" }, `✓ uploaded ${r.name} (${fmtBytes(r.size_bytes)})`));
      file.value = ""; name.value = "";
      refresh();
    });
    return card("Upload", h("p", { class: "muted" }, "A PEFT adapter (adapter_config.json + adapter_model.safetensors) as .tar.gz."),
      field("name", name), field("archive", file), button, out);
  }

  function mergeCard() {
    const sources = h("div", { id: "merge-sources" });
    const output = input({ id: "merge-output", placeholder: "output adapter name" });
    const mode = select([["weighted_average", "weighted average"], ["ties", "TIES"], ["concat", "concat (any ranks)"]], { id: "merge-mode" });
    const density = input({ id: "merge-density", type: "number", step: "0.05", min: "0", max: "1", placeholder: "TIES only (default 0.2)" });
    const out = h("div");
    const addSource = async (weight = 1) => {
      const names = ((await get("/v1/adapters")).available || []).map((a) => a.name);
      const nameSel = select(names, { class: "merge-name" });
      nameSel.value = names[sources.children.length % Math.max(1, names.length)] || "";
      const row = h("div", { class: "row compact merge-source" }, nameSel,
        input({ class: "merge-weight", type: "number", step: "0.1", value: String(weight), "aria-label": "weight" }),
        h("button", { class: "small", onclick: () => row.remove() }, "×"));
      sources.append(row);
    };
    const button = h("button", { class: "primary", id: "merge-submit" }, "Merge");
    button.onclick = () => act(button, out, async () => {
      const body = { sources: [...sources.querySelectorAll(".merge-source")].map((r) => ({
        name: r.querySelector(".merge-name").value, weight: Number(r.querySelector(".merge-weight").value) })),
        output_name: output.value.trim(), mode: mode.value };
      if (density.value) body.density = Number(density.value);
      const r = await post("/v1/adapters/merge", body);
      clear(out, h("div", { class: "ok-note" }, `✓ merged into ${r.output_name}`));
      refresh();
    });
    addSource(0.5).then(() => addSource(0.5)).catch(() => {});
    return card("Merge", sources, h("button", { class: "small", onclick: () => addSource(1) }, "+ source"),
      h("div", { class: "grid2" }, field("output", output), field("mode", mode), field("density", density)), button, out);
  }

  await refresh();
}
