// Helpers shared by the views: DOM building (text only, never HTML strings), formatting, and the API client
// (the API key asked on a 401, kept in sessionStorage, sent as Authorization: Bearer).

const KEY = "corral.apikey";

export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  if (attrs) {
    for (const [k, v] of Object.entries(attrs)) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (k === "dataset") Object.assign(node.dataset, v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

export function fmtBytes(n) {
  if (n === undefined || n === null || isNaN(n)) return "";
  const units = [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["KB", 1e3]];
  for (const [u, s] of units) if (Math.abs(n) >= s) return (n / s).toFixed(1) + " " + u;
  return Math.round(n) + " B";
}

export function fmtDuration(s) {
  if (s === undefined || s === null || !isFinite(s)) return "";
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
}

export function fmtAgo(iso) {
  const t = Date.parse(iso);
  if (isNaN(t)) return "";
  const d = (Date.now() - t) / 1000;
  if (d < 60) return "just now";
  if (d < 3600) return Math.floor(d / 60) + " min ago";
  if (d < 86400) return Math.floor(d / 3600) + " h ago";
  return Math.floor(d / 86400) + " days ago";
}

export function notice(text) {
  const n = $("#notice");
  if (!text) { n.hidden = true; n.textContent = ""; return; }
  n.textContent = text;
  n.hidden = false;
}

export function setReady(v) {
  document.body.dataset.ready = v ? "1" : "0";
}

// ---- API key ----
let asking = null;

function askKey(refused) {
  if (asking) return asking;
  const dlg = $("#apikey-dialog");
  const input = $("#apikey-input");
  $("#apikey-error").hidden = !refused;
  input.value = "";
  asking = new Promise((resolve) => {
    const done = () => {
      dlg.removeEventListener("close", done);
      const key = dlg.returnValue === "save" ? input.value.trim() : "";
      asking = null;
      if (key) sessionStorage.setItem(KEY, key);
      resolve(Boolean(key));
    };
    dlg.addEventListener("close", done);
  });
  dlg.returnValue = "";
  if (!dlg.open) dlg.showModal();
  input.focus();
  return asking;
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// fetch with the key; on 401 ask for it (once for all calls waiting) and retry. `opts.json` is sent as JSON.
export async function api(path, opts = {}) {
  for (let attempt = 0; ; attempt++) {
    const headers = new Headers(opts.headers || {});
    const key = sessionStorage.getItem(KEY);
    if (key) headers.set("Authorization", "Bearer " + key);
    let body = opts.body;
    if (opts.json !== undefined) {
      headers.set("Content-Type", "application/json");
      body = JSON.stringify(opts.json);
    }
    const res = await fetch(path, { method: opts.method || (body ? "POST" : "GET"), headers, body, signal: opts.signal });
    if (res.status === 401 && attempt < 5) {
      if (key) sessionStorage.removeItem(KEY);
      const given = await askKey(Boolean(key));
      if (!given) throw new ApiError(401, "an API key is needed: reload the page to enter it");
      continue;
    }
    if (!res.ok && !opts.raw) {
      let msg = res.status + " " + res.statusText;
      try {
        const j = await res.json();
        if (j && j.error) msg = typeof j.error === "string" ? j.error : j.error.message || JSON.stringify(j.error);
      } catch (_) {
        // DoorGuard answers an origin or host it refuses with an empty 403
        if (res.status === 403) {
          msg = `the daemon refused this page's address (${location.origin}): open the page as http://127.0.0.1:<port>/ui or http://localhost:<port>/ui, or add ${location.origin} to CORRAL_ORIGINS`;
        }
      }
      throw new ApiError(res.status, msg);
    }
    return res;
  }
}

export async function apiJSON(path, opts) {
  const res = await api(path, opts);
  const text = await res.text();
  return text ? JSON.parse(text) : {};
}

// Read an NDJSON body line by line: onLine(obj) for each; resolves when the stream ends.
export async function readNDJSON(res, onLine) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, i).trim();
      buf = buf.slice(i + 1);
      if (line) onLine(JSON.parse(line));
    }
  }
  buf += dec.decode();
  if (buf.trim()) onLine(JSON.parse(buf.trim()));
}

// A modal question with one line of text; resolves to the text or null.
export function promptText(question, value) {
  const dlg = $("#prompt-dialog");
  $("#prompt-text").textContent = question;
  const input = $("#prompt-input");
  input.value = value || "";
  return new Promise((resolve) => {
    const done = () => {
      dlg.removeEventListener("close", done);
      resolve(dlg.returnValue === "ok" ? input.value : null);
    };
    dlg.returnValue = "";
    dlg.addEventListener("close", done);
    dlg.showModal();
    input.select();
  });
}

export function confirmDialog(text, yesLabel) {
  const dlg = $("#confirm");
  $("#confirm-text").textContent = text;
  $("#confirm-yes").textContent = yesLabel || "Delete";
  return new Promise((resolve) => {
    const done = () => {
      dlg.removeEventListener("close", done);
      resolve(dlg.returnValue === "yes");
    };
    dlg.returnValue = "";
    dlg.addEventListener("close", done);
    dlg.showModal();
    $("#confirm-no").focus();
  });
}
