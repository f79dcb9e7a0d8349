// corral's web page: hash routing between the three views (#models, #running, #chat).
// document.body.dataset.ready is "1" once the current view's first data load has finished.

import { $, $$, apiJSON, notice, setReady } from "./util.js";
import * as models from "./models.js";
import * as running from "./running.js";
import * as chat from "./chat.js";

const VIEWS = { models, running, chat };
let current = null;
let generation = 0;

async function show() {
  const name = (location.hash || "#models").slice(1);
  const view = VIEWS[name] ? name : "models";
  if (current && current !== view) VIEWS[current].leave?.();
  current = view;
  const mine = ++generation;
  setReady(false);
  notice("");
  for (const [n] of Object.entries(VIEWS)) {
    $("#view-" + n).hidden = n !== view;
  }
  for (const a of $$("a[data-view]")) {
    if (a.dataset.view === view) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  try {
    await VIEWS[view].enter();
  } catch (err) {
    notice(String(err.message || err));
  }
  if (mine === generation) setReady(true);
}

async function start() {
  setReady(false);
  for (const v of Object.values(VIEWS)) v.init();
  window.addEventListener("hashchange", show);
  for (const a of $$("a[data-view]")) {
    // the current view's link reloads its data (no hashchange fires for the same hash)
    a.addEventListener("click", (e) => {
      if (location.hash === "#" + a.dataset.view) { e.preventDefault(); show(); }
    });
  }
  apiJSON("/api/version").then((v) => {
    $("#daemon-version").textContent = "corral " + (v.corral_version || "") + " (Ollama API " + v.version + ")";
  }).catch(() => {});
  await show();
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();
