// The Running view: loaded models (/api/ps) with RAM/VRAM bars against the budgets (/api/info), unload now, the
// hardware, and live tokens per second and requests per second from the Prometheus counters of /metrics.

import { $, el, api, apiJSON, fmtBytes, fmtDuration, notice } from "./util.js";

let timer = null;
let visible = false;
let info = null;
let last = null; // {t, tokens, requests}
const history = []; // tokens/s samples for the sparkline

export function init() {
  $("#running-table tbody").addEventListener("click", async (e) => {
    const b = e.target.closest("button.unload[data-model]");
    if (!b) return;
    b.disabled = true;
    try {
      await api("/api/generate", { json: { model: b.dataset.model, keep_alive: 0 } });
      await loadPs();
    } catch (err) {
      notice(err.message);
      b.disabled = false;
    }
  });
}

export async function enter() {
  visible = true;
  info = await apiJSON("/api/info");
  renderHardware();
  await Promise.all([loadPs(), loadMetrics()]);
  schedule();
}

export function leave() {
  visible = false;
  clearTimeout(timer);
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(async () => {
    if (!visible) return;
    try { await Promise.all([loadPs(), loadMetrics()]); } catch (err) { notice(err.message); }
    schedule();
  }, 2000);
}

function bar(cls, used, budget, label) {
  const pct = budget > 0 ? Math.min(100, (100 * used) / budget) : 0;
  const meter = el("meter", { min: 0, max: budget > 0 ? budget : 1, value: budget > 0 ? Math.min(used, budget) : 0, "aria-label": label });
  return el("div", { class: "bar " + cls, title: `${fmtBytes(used)} of ${budget > 0 ? fmtBytes(budget) : "no budget"}` },
    meter, el("span", { text: `${fmtBytes(used)}${budget > 0 ? " / " + fmtBytes(budget) + " (" + pct.toFixed(0) + "%)" : ""}` }));
}

async function loadPs() {
  const ps = await apiJSON("/api/ps");
  const budgets = (info && info.budgets) || {};
  const rows = (ps.models || []).map((m) => {
    const vram = m.size_vram || 0;
    const ram = Math.max(0, (m.size || 0) - vram);
    const slots = m.slots || [];
    const busy = slots.filter((s) => s.busy).length;
    const until = (Date.parse(m.expires_at) - Date.now()) / 1000;
    const unloads = isNaN(until) ? "" : until > 3.15e9 ? "never" : until <= 0 ? "now" : "in " + fmtDuration(until);
    return el("tr", { dataset: { model: m.name } },
      el("th", { scope: "row" }, m.name, m.draft_model ? el("div", { class: "muted", text: "draft: " + m.draft_model }) : null,
        m.fallback ? el("div", { class: "muted", text: "fallback: " + (m.fallback.reason || JSON.stringify(m.fallback)) }) : null),
      el("td", {}, bar("ram-bar", ram, budgets.ram || 0, "RAM of " + m.name)),
      el("td", {}, bar("vram-bar", vram, budgets.vram || 0, "VRAM of " + m.name)),
      el("td", { class: "num", text: String(m.context_length || "") }),
      el("td", { text: m.kv_cache_type || "" }),
      el("td", { class: "num", text: slots.length ? `${busy} / ${slots.length}` : String(m.num_parallel || "") }),
      el("td", { title: m.expires_at || "", text: unloads }),
      el("td", {}, el("button", { type: "button", class: "unload", dataset: { model: m.name }, text: "Unload now" })));
  });
  $("#running-table tbody").replaceChildren(...rows);
  $("#running-empty").hidden = rows.length > 0;
  const total = (ps.models || []).reduce((a, m) => ({ ram: a.ram + Math.max(0, m.size - (m.size_vram || 0)), vram: a.vram + (m.size_vram || 0) }), { ram: 0, vram: 0 });
  $("#budgets").replaceChildren(
    el("div", { class: "row" }, el("span", { class: "label", text: "RAM in use" }), bar("ram-total", total.ram, budgets.ram || 0, "RAM in use")),
    el("div", { class: "row" }, el("span", { class: "label", text: "VRAM in use" }), bar("vram-total", total.vram, budgets.vram || 0, "VRAM in use")));
}

// the endpoints that run a model (the page's own polling is not counted as requests)
const MODEL_ENDPOINTS = ["/api/generate", "/api/chat", "/api/embed", "/api/embeddings", "/v1/chat/completions",
  "/v1/completions", "/v1/embeddings", "/v1/messages", "/v1/responses", "/api/rerank", "/v1/rerank"];

// Sum the samples of one metric family in Prometheus' text format (those whose labels pass `keep`, if given).
export function metricSum(text, name, keep) {
  let sum = 0;
  for (const line of text.split("\n")) {
    if (!line.startsWith(name)) continue;
    const rest = line.slice(name.length);
    if (rest[0] !== " " && rest[0] !== "{") continue;
    if (keep && !keep(rest[0] === "{" ? rest.slice(1, rest.indexOf("}")) : "")) continue;
    const v = parseFloat(line.slice(line.lastIndexOf(" ") + 1));
    if (!isNaN(v)) sum += v;
  }
  return sum;
}

async function loadMetrics() {
  const res = await api("/metrics");
  const text = await res.text();
  const now = performance.now() / 1000;
  const cur = { t: now, tokens: metricSum(text, "corral_generated_tokens_total"), requests: metricSum(text, "corral_requests_total", (labels) => MODEL_ENDPOINTS.some((e) => labels.includes(`endpoint="${e}"`))), prompt: metricSum(text, "corral_prompt_tokens_total") };
  let tps = 0, rps = 0;
  if (last && cur.t > last.t) {
    tps = Math.max(0, (cur.tokens - last.tokens) / (cur.t - last.t));
    rps = Math.max(0, (cur.requests - last.requests) / (cur.t - last.t));
  }
  last = cur;
  history.push(tps);
  if (history.length > 60) history.shift();
  const max = Math.max(1, ...history);
  const spark = el("div", { class: "spark", "aria-hidden": "true" },
    history.map((v) => el("span", { style: null, dataset: { v: String(Math.round((100 * v) / max)) } })));
  for (const s of spark.children) s.style.setProperty("--h", s.dataset.v + "%");
  $("#live").replaceChildren(
    el("dl", { class: "facts" },
      el("dt", { text: "Tokens per second (generated)" }), el("dd", { id: "live-tps", text: tps.toFixed(1) }),
      el("dt", { text: "Model requests per second" }), el("dd", { id: "live-rps", text: rps.toFixed(2) }),
      el("dt", { text: "Tokens generated" }), el("dd", { text: String(cur.tokens) }),
      el("dt", { text: "Prompt tokens" }), el("dd", { text: String(cur.prompt) }),
      el("dt", { text: "Model requests (generate, chat, embed, OpenAI, Anthropic)" }), el("dd", { text: String(cur.requests) })),
    spark);
}

function renderHardware() {
  const hw = (info && info.hardware) || {};
  const b = (info && info.budgets) || {};
  const dl = el("dl", { class: "facts" });
  const fact = (k, v) => { if (v !== undefined && v !== null && v !== "") dl.append(el("dt", { text: k }), el("dd", { text: typeof v === "object" ? JSON.stringify(v) : String(v) })); };
  fact("Cores", `${hw.physical_cores} physical, ${hw.logical_cores} logical`);
  fact("Instruction sets", (hw.cpu_features || []).join(" "));
  fact("RAM", `${fmtBytes(hw.available_ram)} available of ${fmtBytes(hw.total_ram)}`);
  fact("RAM budget", b.ram !== undefined ? `${fmtBytes(b.ram)} (${b.ram_source || ""})` : undefined);
  fact("VRAM budget", b.vram !== undefined ? `${fmtBytes(b.vram)} (${b.vram_source || ""})` : undefined);
  fact("Max loaded models", b.max_loaded_models ? b.max_loaded_models : "as many as fit the budgets");
  fact("GPU offload", hw.gpu_offload ? "yes" : "no" + (hw.gpu_reason ? ": " + hw.gpu_reason : ""));
  fact("Unified memory", hw.unified_memory ? "yes" : undefined);
  fact("llama.cpp backends", (hw.backends || []).join(", "));
  for (const g of hw.gpus || []) {
    fact("GPU " + g.index, `${g.name} (${g.backend || "?"} ${g.device || ""}) ${fmtBytes(g.free_vram)} free of ${fmtBytes(g.total_vram)}, driver ${g.driver || "?"}, compute ${g.compute_capability || "?"}`);
  }
  for (const d of hw.devices || []) {
    fact("Device " + d.index, `${d.name}: ${d.description} [${d.backend}, ${d.type}]${d.memory_total ? " " + fmtBytes(d.memory_total) : ""}`);
  }
  fact("System", hw.system_info);
  fact("Probe", hw.probe);
  const settings = (info && info.settings) || {};
  const sdl = el("dl", { class: "facts" });
  for (const [k, v] of Object.entries(settings)) sdl.append(el("dt", { text: k }), el("dd", { text: String(v) }));
  $("#hardware").replaceChildren(dl, el("details", {}, el("summary", { text: "Settings in force" }), sdl));
}
