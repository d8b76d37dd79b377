// The dashboard shell: hash routing between pages, polling that stops when a page is left, the
// server-status dot, and the API-key prompt (shown when the server answers 401 invalid_api_key).

import { get, setApiKey, setUnauthorizedHandler, apiKey } from "./api.js";
import { clear, errorBox, h } from "./dom.js";
import * as overview from "./overview.js";
import * as playground from "./playground.js";
import * as adapters from "./adapters.js";
import * as training from "./training.js";
import * as evals from "./evals.js";
import * as data from "./data.js";
import * as requests from "./requests.js";

const PAGES = { overview, playground, adapters, training, evals, data, requests };

let current = null; // {timers: [], aborted: bool}

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [name, query] = raw.split("?");
  return { name: PAGES[name] ? name : "overview", params: new URLSearchParams(query || "") };
}

function makeContext(params) {
  const ctx = {
    params,
    timers: [],
    left: false,
    // Run fn now and then every ms while this page is shown; a slow fn never overlaps itself.
    every(ms, fn) {
      let busy = false;
      const tick = async () => {
        if (ctx.left || busy || document.hidden) return;
        busy = true;
        try { await fn(); } catch (err) { console.warn(err); } finally { busy = false; }
      };
      tick();
      ctx.timers.push(setInterval(tick, ms));
    },
    go(hash) { location.hash = hash; },
  };
  return ctx;
}

async function show() {
  if (current) {
    current.left = true;
    current.timers.forEach(clearInterval);
  }
  const { name, params } = parseHash();
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.page === name);
  const root = document.getElementById("page");
  root.dataset.page = name;
  clear(root);
  const ctx = makeContext(params);
  current = ctx;
  try {
    await PAGES[name].render(root, ctx);
  } catch (err) {
    root.append(errorBox(err));
  }
}

// ---- the API-key prompt ---------------------------------------------------------------------------

let pendingKey = null;
function askForKey(envelope) {
  if (pendingKey) return pendingKey;
  pendingKey = new Promise((resolve) => {
    const keyInput = h("input", { type: "password", id: "api-key-input", autocomplete: "current-password",
      placeholder: "API key", value: "" });
    const done = (ok) => {
      dialog.remove();
      pendingKey = null;
      resolve(ok);
    };
    const dialog = h("div", { class: "modal-backdrop", id: "api-key-dialog" },
      h("form", { class: "modal", onsubmit: (e) => { e.preventDefault(); setApiKey(keyInput.value.trim()); done(!!keyInput.value.trim()); } },
        h("h2", {}, "This server needs an API key"),
        h("p", {}, envelope.message || "The server answered 401."),
        envelope.hint ? h("p", { class: "muted" }, envelope.hint) : null,
        apiKey() ? h("p", { class: "error-hint" }, "The stored key was refused.") : null,
        keyInput,
        h("p", { class: "muted" }, "Kept in this browser (localStorage) and sent as Authorization: Bearer on every call."),
        h("div", { class: "row" },
          h("button", { type: "submit", class: "primary", id: "api-key-save" }, "Use key"),
          h("button", { type: "button", onclick: () => done(false) }, "Cancel"))));
    document.body.append(dialog);
    keyInput.focus();
  });
  return pendingKey;
}

async function statusDot() {
  const dot = document.getElementById("server-status");
  try {
    const health = await get("/health");
    dot.className = "status-dot ok";
    dot.title = `server ${health.status}`;
  } catch (err) {
    dot.className = `status-dot ${err.status === 503 ? "warn" : "bad"}`;
    dot.title = err.message;
  }
}

function keyIcon() {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("width", "18");
  svg.setAttribute("height", "18");
  svg.innerHTML = '<circle cx="8" cy="12" r="4" fill="none" stroke="currentColor" stroke-width="2"/>' +
    '<path d="M12 12h9M18 12v3M21 12v2" fill="none" stroke="currentColor" stroke-width="2" stroke-linecap="round"/>';
  return svg;
}

function keyButton() {
  const nav = document.querySelector(".topbar");
  nav.append(h("button", { class: "key-button", id: "api-key-button", "aria-label": "API key", title: "Set or clear the API key this page sends",
    onclick: async () => {
      if (apiKey() && confirm("Forget the stored API key?")) { setApiKey(""); return; }
      await askForKey({ message: "Enter the key the server was started with (--api-key)." });
    } }, keyIcon()));
}

setUnauthorizedHandler(askForKey);
window.addEventListener("hashchange", show);
window.addEventListener("DOMContentLoaded", () => {
  keyButton();
  show();
  statusDot();
  setInterval(statusDot, 5000);
});
