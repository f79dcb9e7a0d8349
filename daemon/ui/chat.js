// The Chat view: streaming /api/chat with Stop (aborting the fetch ends the request; the daemon frees the slot),
// thinking apart from the answer, images for vision models, tool calls, options, Markdown rendered safely, and
// conversations kept in localStorage (several, renamable, exportable as JSON), regenerate and edit-and-resend.

import { $, $$, el, api, apiJSON, readNDJSON, notice, promptText, confirmDialog } from "./util.js";
import { renderMarkdown } from "./markdown.js";

const STORE = "corral.conversations";
const CURRENT = "corral.current";
const DELETED = "corral.deleted"; // ids of conversations deleted in some tab: another tab's save must not revive them
const DELETED_KEEP = 500;

let models = []; // from /api/tags
let convs = [];
let current = null; // the conversation shown
let pending = []; // images attached to the next message: {data (base64), url (data: URL), name}
let controller = null; // the running stream's AbortController

// ---- storage ----
// Several tabs share one store: each save merges what this tab holds with what the others saved since, so no tab
// undoes another's work. A conversation both hold is the one changed last (``updated``); one only the store holds
// is another tab's (kept); one deleted in any tab is gone everywhere. The conversation whose answer is streaming
// here stays this tab's own until it ends.
function stored() {
  try {
    const v = JSON.parse(localStorage.getItem(STORE) || "[]");
    return Array.isArray(v) ? v.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages)) : [];
  } catch (_) {
    return [];
  }
}

function deleted() {
  try {
    const v = JSON.parse(localStorage.getItem(DELETED) || "[]");
    return Array.isArray(v) ? v.filter((id) => typeof id === "string") : [];
  } catch (_) {
    return [];
  }
}

function load() {
  convs = stored();
}

function merge() {
  const gone = new Set(deleted());
  const mine = new Map(convs.map((c) => [c.id, c]));
  for (const c of stored()) {
    const have = mine.get(c.id);
    const busy = controller && have === current;
    if (!have || (!busy && (c.updated || 0) > (have.updated || 0))) mine.set(c.id, c);
  }
  const kept = (c) => !gone.has(c.id) || (controller && c === current); // deleted elsewhere: after its answer
  convs = [...mine.values()].filter(kept).sort((a, b) => (b.created || 0) - (a.created || 0));
  if (current) current = convs.find((c) => c.id === current.id) || null;
}

// ``changed``: the conversation this tab has just changed (the shown one unless said), or null for none
function save(changed = current) {
  if (changed) changed.updated = Math.max(Date.now(), (changed.updated || 0) + 1);
  merge();
  try {
    localStorage.setItem(STORE, JSON.stringify(convs));
  } catch (err) {
    notice("cannot keep the conversations in this browser: " + err.message + " (images take much room: export and delete old ones)");
  }
}

function forget(c) {
  convs = convs.filter((x) => x !== c);
  try {
    localStorage.setItem(DELETED, JSON.stringify([...deleted().filter((id) => id !== c.id), c.id].slice(-DELETED_KEEP)));
  } catch (_) { /* the store is full: the conversation still goes from this tab's list below */ }
  save(null);
}

function newConversation() {
  const c = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", model: $("#chat-model").value || "", system: "", messages: [], created: Date.now(), updated: Date.now() };
  convs.unshift(c);
  select(c.id);
  save();
}

function select(id) {
  current = convs.find((c) => c.id === id) || null;
  if (!current) return;
  localStorage.setItem(CURRENT, id);
  $("#chat-system").value = current.system || "";
  $("#chat-tools").value = current.tools || "";
  if (current.model && models.some((m) => m.name === current.model)) $("#chat-model").value = current.model;
  modelChanged();
  renderConversations();
  renderMessages();
}

// ---- view ----
export function init() {
  load();
  $("#new-chat").addEventListener("click", () => {
    if (controller) return;
    if (current && !current.messages.length) select(current.id); // this one is still empty: use it
    else newConversation();
    $("#chat-input").focus();
  });
  $("#export-chat").addEventListener("click", exportChat);
  $("#chat-form").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("#chat-stop").addEventListener("click", stop);
  $("#chat-model").addEventListener("change", () => { if (current) { current.model = $("#chat-model").value; save(); } modelChanged(); });
  $("#chat-system").addEventListener("change", () => { if (current) { current.system = $("#chat-system").value; save(); } });
  $("#chat-tools").addEventListener("change", () => { if (current) { current.tools = $("#chat-tools").value; save(); } });
  const input = $("#chat-input");
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    if (e.key === "Escape" && controller) { e.preventDefault(); stop(); }
  });
  input.addEventListener("dragover", (e) => { e.preventDefault(); input.classList.add("drop"); });
  input.addEventListener("dragleave", () => input.classList.remove("drop"));
  input.addEventListener("drop", (e) => { e.preventDefault(); input.classList.remove("drop"); addImages(e.dataTransfer.files); });
  input.addEventListener("paste", (e) => {
    const files = Array.from(e.clipboardData?.files || []).filter((f) => f.type.startsWith("image/"));
    if (files.length) { e.preventDefault(); addImages(files); }
  });
  $("#chat-image").addEventListener("change", (e) => { addImages(e.target.files); e.target.value = ""; });
  $("#conversations").addEventListener("click", onConversationClick);
  $("#messages").addEventListener("click", onMessageClick);
  window.addEventListener("storage", (e) => { // another tab saved its conversations: show them here too
    if (e.key !== STORE && e.key !== DELETED) return;
    const shown = current;
    merge();
    if (!current && convs.length) current = convs[0];
    if (!current) { newConversation(); return; }
    renderConversations();
    if (current !== shown && !controller) select(current.id); // its own answer keeps streaming into the page
  });
}

export async function enter() {
  const data = await apiJSON("/api/tags");
  models = (data.models || []).filter((m) => !(m.capabilities || []).length || (m.capabilities || []).includes("completion"));
  const sel = $("#chat-model");
  const keep = sel.value;
  sel.replaceChildren(...models.map((m) => el("option", { value: m.name, text: m.name })));
  if (controller && current) { // a stream is running: leave its conversation on screen as it is
    sel.value = current.model;
    modelChanged();
    return;
  }
  const wanted = sessionStorage.getItem("corral.chat-model");
  sessionStorage.removeItem("corral.chat-model");
  if (!convs.length) newConversation();
  const id = localStorage.getItem(CURRENT);
  if (!current) select(convs.some((c) => c.id === id) ? id : convs[0].id);
  if (wanted && models.some((m) => m.name === wanted)) {
    if (current.messages.length && current.model !== wanted) newConversation();
    sel.value = wanted;
    current.model = wanted;
    save();
  } else if (current.model && models.some((m) => m.name === current.model)) sel.value = current.model;
  else if (keep && models.some((m) => m.name === keep)) sel.value = keep;
  modelChanged();
  renderConversations();
  renderMessages();
  if (!models.length) notice("No chat model in the store: pull or create one on the Models view.");
}

export function leave() {}

function caps() {
  const m = models.find((x) => x.name === $("#chat-model").value);
  return (m && m.capabilities) || [];
}

function modelChanged() {
  const c = caps();
  const think = $("#opt-think");
  think.disabled = !c.includes("thinking");
  if (think.disabled) think.value = "";
  $("#chat-image").disabled = !c.includes("vision");
  $("#chat-image").closest("label").title = c.includes("vision") ? "Attach images" : "This model does not take images";
}

// ---- conversations list ----
function renderConversations() {
  const items = convs.map((c) => el("li", { class: "conversation" + (current && c.id === current.id ? " current" : ""), dataset: { id: c.id } },
    el("button", { type: "button", class: "link open-conv", "aria-current": current && c.id === current.id ? "true" : null, text: c.title || "Untitled" }),
    el("button", { type: "button", class: "rename icon", title: "Rename", "aria-label": "Rename " + (c.title || ""), text: "✎" }),
    el("button", { type: "button", class: "remove icon", title: "Delete", "aria-label": "Delete " + (c.title || ""), text: "×" })));
  $("#conversations").replaceChildren(...items);
}

async function onConversationClick(e) {
  const li = e.target.closest(".conversation");
  if (!li || controller) return;
  const c = convs.find((x) => x.id === li.dataset.id);
  if (!c) return;
  if (e.target.closest(".rename")) {
    const t = await promptText("Rename the conversation:", c.title);
    if (t !== null && t.trim()) { c.title = t.trim(); save(c); renderConversations(); }
  } else if (e.target.closest(".remove")) {
    if (!(await confirmDialog(`Delete the conversation "${c.title}"?`, "Delete"))) return;
    const shown = current === c;
    forget(c);
    if (shown) { current = null; if (convs.length) select(convs[0].id); else newConversation(); }
    renderConversations();
  } else {
    select(c.id);
  }
}

function exportChat() {
  if (!current) return;
  const blob = new Blob([JSON.stringify(current, null, 2)], { type: "application/json" });
  const url = URL.createObjectURL(blob);
  const a = el("a", { href: url, download: (current.title || "chat").replace(/[^\w.-]+/g, "_").slice(0, 60) + ".json" });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// ---- images ----
function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

async function addImages(files) {
  const list = Array.from(files || []).filter((f) => f.type.startsWith("image/"));
  if (!list.length) return;
  if (!caps().includes("vision")) { notice(`${$("#chat-model").value || "this model"} does not take images (no vision capability)`); return; }
  for (const f of list) {
    const url = await readAsDataURL(f);
    pending.push({ name: f.name, url, data: url.slice(url.indexOf(",") + 1) });
  }
  renderPending();
}

function renderPending() {
  $("#chat-images").replaceChildren(...pending.map((p, i) => el("span", { class: "thumb" },
    imgFromData(p.url, p.name),
    el("button", { type: "button", class: "icon", "aria-label": "Remove " + p.name, text: "×", onclick: () => { pending.splice(i, 1); renderPending(); } }))));
}

// the data: URL of an image kept as base64 (as /api/chat takes it), its type from its first bytes
function dataURL(b64) {
  const types = { iVBORw0KGgo: "png", "/9j/": "jpeg", R0lGOD: "gif", UklGR: "webp", Qk: "bmp" };
  const hit = Object.keys(types).find((p) => b64.startsWith(p));
  return "data:image/" + (hit ? types[hit] : "png") + ";base64," + b64;
}

function imgFromData(url, alt) {
  // only data: URLs of the user's own images: nothing from a model's output is ever loaded
  if (!/^data:image\/[\w.+-]+;base64,/.test(url)) return el("span", { text: alt || "image" });
  return el("img", { src: url, alt: alt || "image", class: "thumb-img" });
}

// ---- messages ----
function renderMessages() {
  const box = $("#messages");
  box.replaceChildren(...(current ? current.messages.map((m, i) => messageNode(m, i)) : []));
  box.scrollTop = box.scrollHeight;
}

function messageNode(m, index) {
  const node = el("article", { class: "msg " + m.role, dataset: { index: String(index) } });
  if (m.role === "user") {
    node.append(el("div", { class: "who", text: "You" }));
    if (m.images && m.images.length) node.append(el("div", { class: "thumbs" }, m.images.map((b64) => imgFromData(dataURL(b64), "attached image"))));
    node.append(el("div", { class: "content" }, renderMarkdown(m.content)));
    node.append(el("div", { class: "msg-actions" }, el("button", { type: "button", class: "edit", text: "Edit" })));
  } else {
    node.append(el("div", { class: "who", text: m.model || "assistant" }));
    const answer = el("div", { class: "answer" });
    fillAssistant(node, answer, m);
    answer.dataset.done = "1";
    answer.dataset.updates = String(m.updates || 0);
    node.append(el("div", { class: "msg-actions" }, el("button", { type: "button", class: "regenerate", text: "Regenerate" })));
  }
  return node;
}

// (re)draw an assistant message's thinking, answer and tool calls into node
function fillAssistant(node, answer, m) {
  let thinking = $("details.thinking", node);
  if (m.thinking) {
    if (!thinking) {
      thinking = el("details", { class: "thinking" }, el("summary", { text: "Thinking" }), el("div", { class: "thinking-text" }));
      node.insertBefore(thinking, node.children[1] || null);
    }
    $(".thinking-text", thinking).replaceChildren(renderMarkdown(m.thinking));
    $("summary", thinking).textContent = m.streaming && !m.content ? "Thinking…" : "Thinking";
  }
  if (!answer.parentNode) node.append(answer);
  answer.replaceChildren(renderMarkdown(m.content || ""));
  for (const old of $$(".tool-call", node)) old.remove();
  for (const tc of m.tool_calls || []) {
    const f = tc.function || {};
    node.insertBefore(el("div", { class: "tool-call" },
      el("span", { class: "tool-label", text: "tool call" }), " ",
      el("code", { class: "tool-name", text: f.name || "" }),
      el("pre", { text: JSON.stringify(f.arguments || {}, null, 2) })), answer.nextSibling);
  }
  let err = $(".msg-error", node);
  if (m.error) {
    if (!err) { err = el("div", { class: "msg-error error" }); answer.after(err); }
    err.textContent = m.error;
  } else if (err) err.remove();
  let stats = $(".stats", node);
  if (m.stats) {
    if (!stats) { stats = el("div", { class: "stats muted" }); node.append(stats); }
    stats.textContent = m.stats;
  }
}

function onMessageClick(e) {
  const b = e.target.closest("button.regenerate, button.edit");
  if (!b || controller || !current) return;
  const idx = parseInt(b.closest(".msg").dataset.index, 10);
  if (b.classList.contains("regenerate")) {
    let tools;
    try { tools = readTools(); } catch (err) { notice(err.message); return; }
    current.messages = current.messages.slice(0, idx); // drop this answer (and what followed), ask again
    save();
    renderMessages();
    run(tools);
  } else {
    const m = current.messages[idx];
    current.messages = current.messages.slice(0, idx);
    save();
    renderMessages();
    $("#chat-input").value = m.content;
    pending = (m.images || []).map((b64, i) => ({ name: "image " + (i + 1), data: b64, url: dataURL(b64) }));
    renderPending();
    $("#chat-input").focus();
  }
}

// ---- sending ----
function options() {
  const o = {};
  const t = $("#opt-temperature").value;
  if (t !== "") o.temperature = parseFloat(t);
  const n = $("#opt-num-ctx").value;
  if (n !== "") o.num_ctx = parseInt(n, 10);
  const s = $("#opt-seed").value;
  if (s !== "") o.seed = parseInt(s, 10);
  return o;
}

function thinkValue() {
  const v = $("#opt-think").value;
  if ($("#opt-think").disabled || v === "") return undefined;
  if (v === "off") return false;
  if (v === "on") return true;
  return v;
}

function send() {
  if (controller) return;
  let tools;
  try { tools = readTools(); } catch (err) { notice(err.message); return; }
  notice("");
  const text = $("#chat-input").value;
  if (!text.trim() && !pending.length) return;
  if (!$("#chat-model").value) { notice("pick a model first (pull or create one on the Models view)"); return; }
  if (!current) newConversation();
  const msg = { role: "user", content: text };
  if (pending.length) msg.images = pending.map((p) => p.data);
  current.messages.push(msg);
  if (current.title === "New chat" && text.trim()) current.title = text.trim().slice(0, 40);
  pending = [];
  renderPending();
  $("#chat-input").value = "";
  save();
  renderConversations();
  renderMessages();
  run(tools);
}

function stop() {
  if (controller) controller.abort();
}

// the Tools box: undefined when empty; a clear error when it is not a JSON array
function readTools() {
  const text = $("#chat-tools").value.trim();
  if (!text) return undefined;
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (err) {
    throw new Error("Tools: not JSON (" + err.message + ")" + TOOLS_HINT);
  }
  if (!Array.isArray(tools)) throw new Error("Tools: not a JSON array" + TOOLS_HINT);
  return tools;
}

const TOOLS_HINT = '. Give an array such as [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], or leave the box empty.';

async function run(tools) {
  const model = $("#chat-model").value;
  current.model = model;
  current.system = $("#chat-system").value;
  current.updated = Date.now();
  const history = [];
  if (current.system.trim()) history.push({ role: "system", content: current.system });
  for (const m of current.messages) {
    const wire = { role: m.role, content: m.content || "" };
    if (m.images) wire.images = m.images;
    if (m.thinking) wire.thinking = m.thinking;
    if (m.tool_calls) wire.tool_calls = m.tool_calls;
    history.push(wire);
  }
  const body = { model, messages: history, stream: true };
  const opts = options();
  if (Object.keys(opts).length) body.options = opts;
  const think = thinkValue();
  if (think !== undefined) body.think = think;
  if (tools) body.tools = tools;

  const m = { role: "assistant", model, content: "", thinking: "", streaming: true };
  const conv = current;
  conv.messages.push(m);
  const index = conv.messages.length - 1;
  const node = el("article", { class: "msg assistant", dataset: { index: String(index) } }, el("div", { class: "who", text: model }));
  const answer = el("div", { class: "answer", dataset: { updates: "0" } });
  node.append(answer);
  $("#messages").append(node);
  const box = $("#messages");
  let updates = 0;
  let scheduled = false;
  let cost = 0; // ms the last render took: a long answer is rendered less often, so the page stays responsive
  const draw = () => {
    scheduled = false;
    const stick = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    const t0 = performance.now();
    fillAssistant(node, answer, m);
    cost = performance.now() - t0;
    updates++;
    answer.dataset.updates = String(updates);
    if (stick) box.scrollTop = box.scrollHeight;
  };
  const later = () => { if (!scheduled) { scheduled = true; setTimeout(draw, Math.max(16, 4 * cost)); } }; // not requestAnimationFrame: it pauses in a hidden tab

  controller = new AbortController();
  $("#chat-stop").disabled = false;
  $("#chat-send").disabled = true;
  try {
    const res = await api("/api/chat", { json: body, signal: controller.signal });
    await readNDJSON(res, (ev) => {
      if (ev.error) { m.error = ev.error; later(); return; }
      const msg = ev.message || {};
      if (msg.thinking) m.thinking += msg.thinking;
      if (msg.content) m.content += msg.content;
      if (msg.tool_calls) m.tool_calls = (m.tool_calls || []).concat(msg.tool_calls);
      if (ev.done) {
        const tps = ev.eval_count && ev.eval_duration ? (ev.eval_count / (ev.eval_duration / 1e9)).toFixed(1) : null;
        m.stats = [ev.done_reason ? "done: " + ev.done_reason : "", ev.eval_count ? ev.eval_count + " tokens" : "", tps ? tps + " tok/s" : ""].filter(Boolean).join(" · ");
      }
      later();
    });
  } catch (err) {
    if (err.name === "AbortError") m.stats = "stopped";
    else m.error = err.message;
  } finally {
    controller = null;
    $("#chat-stop").disabled = true;
    $("#chat-send").disabled = false;
    if (!m.thinking) delete m.thinking;
    delete m.streaming;
    m.updates = updates + 1;
    draw();
    answer.dataset.done = "1";
    node.append(el("div", { class: "msg-actions" }, el("button", { type: "button", class: "regenerate", text: "Regenerate" })));
    save(conv);
  }
}
