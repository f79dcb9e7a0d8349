// The Models view: the list (from /api/tags), details (/api/show), copy, delete with confirmation, pull (background
// pulls: POST/GET/DELETE /api/pulls, so they survive a reload), push, and create from a Modelfile.

import { sha256File } from "./sha256.js";
import { $, $$, el, api, apiJSON, readNDJSON, fmtBytes, fmtDuration, fmtAgo, notice, promptText, confirmDialog } from "./util.js";

let pollTimer = null;
let visible = false;
let dropped = new Map(); // file name -> File (GGUF files dropped with the Modelfile)

export function init() {
  $("#pull-form").addEventListener("submit", (e) => { e.preventDefault(); startPull(); });
  $("#push-form").addEventListener("submit", (e) => { e.preventDefault(); push(); });
  $("#create-form").addEventListener("submit", (e) => { e.preventDefault(); create(); });
  $("#details-close").addEventListener("click", () => { $("#model-details").hidden = true; });
  const ta = $("#create-modelfile");
  ta.addEventListener("dragover", (e) => { e.preventDefault(); ta.classList.add("drop"); });
  ta.addEventListener("dragleave", () => ta.classList.remove("drop"));
  ta.addEventListener("drop", (e) => { e.preventDefault(); ta.classList.remove("drop"); dropFiles(e.dataTransfer.files); });
  $("#models-table tbody").addEventListener("click", onTableClick);
}

export async function enter() {
  visible = true;
  await Promise.all([loadModels(), pollPulls(true)]);
  schedulePoll();
}

export function leave() {
  visible = false;
}

// ---- the list ----
let shown = null; // the /api/tags answer on screen: the table is rebuilt only when it changed

export async function loadModels() {
  const data = await apiJSON("/api/tags");
  const key = JSON.stringify(data.models || []);
  if (key === shown && document.contains($("#models-table tbody"))) return;
  shown = key;
  const body = $("#models-table tbody");
  const rows = (data.models || []).map(row);
  body.replaceChildren(...rows);
  $("#models-empty").hidden = rows.length > 0;
  $("#model-names").replaceChildren(...(data.models || []).map((m) => el("option", { value: m.name })));
}

function row(m) {
  const d = m.details || {};
  const caps = (m.capabilities || []).map((c) => el("span", { class: "cap cap-" + c, text: c }));
  return el("tr", { dataset: { model: m.name } },
    el("th", { scope: "row" }, el("button", { type: "button", class: "link details", dataset: { model: m.name }, text: m.name })),
    el("td", { class: "num", text: fmtBytes(m.size) }),
    el("td", { text: d.family || "" }),
    el("td", { text: d.parameter_size || "" }),
    el("td", { text: d.quantization_level || "" }),
    el("td", { class: "caps" }, caps),
    el("td", { title: m.modified_at || "", text: fmtAgo(m.modified_at) }),
    el("td", { class: "actions" },
      el("button", { type: "button", class: "chat", dataset: { model: m.name }, text: "Chat" }),
      el("button", { type: "button", class: "copy", dataset: { model: m.name }, text: "Copy" }),
      el("button", { type: "button", class: "delete danger", dataset: { model: m.name }, "aria-label": "Delete " + m.name, text: "Delete" })));
}

async function onTableClick(e) {
  const b = e.target.closest("button[data-model]");
  if (!b) return;
  const name = b.dataset.model;
  try {
    if (b.classList.contains("delete")) {
      if (!(await confirmDialog(`Delete ${name}? Its files are removed unless another model uses them.`, "Delete"))) return;
      await api("/api/delete", { method: "DELETE", json: { model: name } });
      $("#model-details").hidden = true;
      await loadModels();
    } else if (b.classList.contains("copy")) {
      const dest = await promptText(`Copy ${name} to the name:`, name.replace(/:[^:/]*$/, "") + "-copy");
      if (!dest) return;
      await api("/api/copy", { json: { source: name, destination: dest } });
      await loadModels();
    } else if (b.classList.contains("chat")) {
      sessionStorage.setItem("corral.chat-model", name);
      location.hash = "#chat";
    } else if (b.classList.contains("details")) {
      await details(name);
    }
  } catch (err) {
    notice(err.message);
  }
}

async function details(name) {
  const info = await apiJSON("/api/show", { json: { model: name } });
  $("#details-title").textContent = name;
  const parts = [];
  const d = info.details || {};
  const dl = el("dl", { class: "facts" });
  const fact = (k, v) => { if (v !== undefined && v !== null && v !== "") dl.append(el("dt", { text: k }), el("dd", { text: String(v) })); };
  fact("Family", d.family);
  fact("Parameters", d.parameter_size);
  fact("Quantization", d.quantization_level);
  fact("Format", d.format);
  fact("Parent", d.parent_model);
  fact("Capabilities", (info.capabilities || []).join(", "));
  const mi = info.model_info || {};
  const arch = mi["general.architecture"];
  if (arch) fact("Context length", mi[arch + ".context_length"]);
  fact("Renderer", info.renderer);
  fact("Parser", info.parser);
  fact("Modified", info.modified_at);
  parts.push(dl);
  const block = (title, text) => {
    if (!text) return;
    parts.push(el("details", { class: "block" }, el("summary", { text: title }), el("pre", { text })));
  };
  block("Modelfile", info.modelfile);
  block("Parameters", info.parameters);
  block("Template", info.template);
  block("System", info.system);
  block("License", info.license);
  if (info.projector_info) {
    block("Projector", Object.entries(info.projector_info).map(([k, v]) => k + ": " + (typeof v === "object" ? JSON.stringify(v) : v)).join("\n"));
  }
  $("#details-body").replaceChildren(...parts);
  const sec = $("#model-details");
  sec.hidden = false;
  $("#details-close").focus();
}

// ---- pulls (in the daemon, followed by polling) ----
function schedulePoll() {
  clearTimeout(pollTimer);
  pollTimer = setTimeout(async () => {
    try { await pollPulls(); } catch (err) { notice(err.message); }
    if (visible) schedulePoll();
  }, anyRunning() ? 400 : 3000);
}

function anyRunning() {
  return $$(".pull", $("#pulls")).some((p) => p.dataset.done !== "1");
}

let succeeded = new Set();
// pulls dismissed from the list (by name and start time), for this tab's session
const DISMISSED = "corral.dismissed-pulls";
function dismissed() {
  try { return new Set(JSON.parse(sessionStorage.getItem(DISMISSED) || "[]")); } catch (_) { return new Set(); }
}
function dismiss(node) {
  const all = dismissed();
  all.add(node.dataset.job || node.dataset.model);
  sessionStorage.setItem(DISMISSED, JSON.stringify(Array.from(all).slice(-200)));
  node.remove();
}

async function pollPulls(first) {
  const data = await apiJSON("/api/pulls");
  const box = $("#pulls");
  const seen = new Set();
  const gone = dismissed();
  for (const job of data.pulls || []) {
    if (job.done && gone.has(job.model + "@" + job.started_at)) continue;
    seen.add(job.model);
    if (first && job.done) succeeded.add(job.model + job.started_at); // ended before this load: listed already
    renderPull(job);
  }
  for (const p of $$(".pull", box)) if (!seen.has(p.dataset.model) && p.dataset.done !== "1") p.dataset.done = "1";
}

function pullNode(name) {
  for (const p of $$(".pull", $("#pulls"))) if (p.dataset.model === name) return p;
  const node = el("div", { class: "pull", dataset: { model: name } },
    el("div", { class: "row spread" }, el("strong", { text: name }),
      el("button", { type: "button", class: "pull-cancel", text: "Cancel", onclick: () => cancelPull(name) }),
      el("button", { type: "button", class: "pull-dismiss", hidden: true, text: "Dismiss", onclick: () => dismiss(node) })),
    el("progress", { max: 1, value: 0 }),
    el("div", { class: "pull-status", text: "starting" }),
    el("ul", { class: "pull-layers" }));
  $("#pulls").prepend(node);
  return node;
}

function renderPull(job) {
  const node = pullNode(job.model);
  const prog = $("progress", node);
  const status = $(".pull-status", node);
  if (job.total > 0) { prog.max = job.total; prog.value = job.completed; }
  let text;
  if (job.error) text = "error: " + job.error;
  else if (job.done && job.status === "success") { text = "success"; prog.max = 1; prog.value = 1; }
  else if (job.total > 0) {
    text = `${job.status} · ${fmtBytes(job.completed)} / ${fmtBytes(job.total)}`;
    if (job.bytes_per_second > 0) text += ` · ${fmtBytes(job.bytes_per_second)}/s`;
    if (job.eta_seconds) text += ` · ETA ${fmtDuration(job.eta_seconds)}`;
  } else text = job.status;
  status.textContent = text;
  status.classList.toggle("error", Boolean(job.error));
  const layers = (job.layers || []).map((l) => el("li", {},
    el("code", { text: l.digest.replace("sha256:", "").slice(0, 12) }), " ",
    el("progress", { max: l.total || 1, value: l.completed }), " ",
    `${fmtBytes(l.completed)} / ${fmtBytes(l.total)}`,
    l.bytes_per_second > 0 && l.completed < l.total ? ` · ${fmtBytes(l.bytes_per_second)}/s · ETA ${fmtDuration(l.eta_seconds)}` : ""));
  $(".pull-layers", node).replaceChildren(...layers);
  node.dataset.done = job.done ? "1" : "0";
  if (job.started_at) node.dataset.job = job.model + "@" + job.started_at;
  $(".pull-cancel", node).hidden = Boolean(job.done);
  $(".pull-dismiss", node).hidden = !job.done;
  if (job.done && job.status === "success" && !succeeded.has(job.model + job.started_at)) {
    succeeded.add(job.model + job.started_at);
    loadModels().catch((err) => notice(err.message));
  }
}

async function startPull() {
  const name = $("#pull-name").value.trim();
  if (!name) { notice("type the name of a model to pull, e.g. registry.example.com/library/smollm2:latest"); return; }
  notice("");
  const node = pullNode(name);
  node.dataset.done = "0";
  $(".pull-status", node).textContent = "starting";
  try {
    const job = await apiJSON("/api/pulls", { json: { model: name, insecure: $("#pull-insecure").checked } });
    renderPull(job);
  } catch (err) {
    renderPull({ model: name, status: "error", error: err.message, done: true, total: 0, completed: 0, layers: [] });
  }
  schedulePoll();
}

async function cancelPull(name) {
  try { await api("/api/pulls", { method: "DELETE", json: { model: name } }); } catch (err) { notice(err.message); }
  schedulePoll();
}

// ---- push ----
async function push() {
  const name = $("#push-name").value.trim();
  const out = $("#push-status");
  if (!name) { out.textContent = "type the name of a model to push"; return; }
  out.textContent = "pushing " + name;
  try {
    const res = await api("/api/push", { json: { model: name, insecure: $("#push-insecure").checked } });
    let last = "";
    await readNDJSON(res, (ev) => {
      if (ev.error) { last = "error: " + ev.error; }
      else if (ev.total) last = `${ev.status} · ${fmtBytes(ev.completed || 0)} / ${fmtBytes(ev.total)}`;
      else last = ev.status;
      out.textContent = last;
    });
  } catch (err) {
    out.textContent = err.message;
  }
}

// ---- create ----
async function dropFiles(files) {
  // a drop with a Modelfile in it starts afresh: the files of an earlier drop are forgotten
  if (Array.from(files).some((f) => !/\.gguf$/i.test(f.name))) dropped = new Map();
  for (const f of files) {
    if (/\.gguf$/i.test(f.name)) dropped.set(f.name, f);
    else if (f.size > 1024 * 1024) notice(`${f.name} is not a Modelfile (over 1 MB): drop a Modelfile and the .gguf files it names`);
    else $("#create-modelfile").value = await f.text(); // the Modelfile itself
  }
  $("#create-files").textContent = dropped.size ? "files: " + Array.from(dropped.keys()).join(", ") : "";
}

function baseName(p) {
  return p.split(/[\\/]/).pop();
}

async function upload(file, out) {
  out.textContent = "hashing " + file.name;
  const digest = await sha256File(file, (done, total) => {
    out.textContent = `hashing ${file.name} ${Math.floor((100 * done) / total)}%`;
  });
  const head = await api("/api/blobs/" + digest, { method: "HEAD", raw: true });
  if (head.status !== 200) {
    out.textContent = "copying " + file.name + " (" + fmtBytes(file.size) + ")";
    await api("/api/blobs/" + digest, { method: "POST", body: file, headers: { "Content-Type": "application/octet-stream" } });
  }
  return digest;
}

async function create() {
  const out = $("#create-status");
  out.classList.remove("error");
  const name = $("#create-name").value.trim();
  const text = $("#create-modelfile").value;
  if (!name) { out.textContent = "type a name for the new model"; out.classList.add("error"); return; }
  const btn = $("#create-button");
  btn.disabled = true;
  try {
    const parsed = await apiJSON("/api/ui/modelfile", { json: { modelfile: text } });
    const payload = Object.assign({ model: name }, parsed.body);
    const lines = (parsed.warnings || []).map((w) => "warning: " + w);
    const files = {};
    for (const value of parsed.froms) {
      const f = dropped.get(baseName(value));
      if (f) files[f.name] = await upload(f, out);
      else if (payload.from && payload.from !== value) {
        throw new Error(`FROM names two models ("${payload.from}" and "${value}"); a Modelfile builds on one model. A FROM that names a file needs that file dropped here.`);
      } else payload.from = value;
    }
    if (Object.keys(files).length) payload.files = files;
    if (parsed.adapters.length) {
      payload.adapters = {};
      for (const value of parsed.adapters) {
        const f = dropped.get(baseName(value));
        if (!f) throw new Error(`ADAPTER ${value}: drop that .gguf file onto the Modelfile box`);
        payload.adapters[f.name] = await upload(f, out);
      }
    }
    const q = $("#create-quantize").value;
    if (q) payload.quantize = q;
    const res = await api("/api/create", { json: payload });
    let failed = false;
    await readNDJSON(res, (ev) => {
      if (ev.error) { lines.push(ev.error); failed = true; }
      else if (ev.total) {
        const last = lines[lines.length - 1] || "";
        const line = `${ev.status} ${Math.floor((100 * (ev.completed || 0)) / ev.total)}%`;
        if (last.startsWith(ev.status)) lines[lines.length - 1] = line; else lines.push(line);
      } else lines.push(ev.status);
      out.textContent = lines.join("\n");
    });
    out.classList.toggle("error", failed);
    if (!failed) await loadModels();
  } catch (err) {
    out.textContent = err.message;
    out.classList.add("error");
  } finally {
    btn.disabled = false;
  }
}
