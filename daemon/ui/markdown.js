// A small Markdown renderer for untrusted text (model output, model metadata). It builds DOM nodes and sets text
// only through textContent / text nodes: no HTML string is ever parsed, so raw HTML in the text shows as text.
// Links keep only http:, https: and mailto: targets (others render as plain text); images are never loaded (an
// image in the text shows as its alt text and address). Supported: headings, paragraphs, fenced and indented code
// blocks, block quotes, ordered and unordered lists, tables, horizontal rules, and inline code, bold, italic,
// strikethrough, links and autolinks.

const SAFE_SCHEMES = ["http:", "https:", "mailto:"];

export function safeHref(raw) {
  const s = String(raw || "").trim();
  // no control characters or whitespace inside the address (they hide a scheme: "java\tscript:")
  if (!s || /[\u0000-\u0020\u007f-\u009f]/.test(s)) return null;
  let url;
  try {
    url = new URL(s);
  } catch (_) {
    return null; // relative addresses would point at the daemon itself: not kept
  }
  return SAFE_SCHEMES.includes(url.protocol) ? url.href : null;
}

function h(tag, cls) {
  const n = document.createElement(tag);
  if (cls) n.className = cls;
  return n;
}

// ---- inline ----
// Bounded repeats ({0,N}) keep a pathological text (thousands of unclosed "*" or "[") from costing quadratic
// time: a span longer than these is shown as plain text.
const INLINE = [
  // [kind, regex anchored at the start]
  ["code", /^(`{1,16})([\s\S]{0,2000}?[^`])\1(?!`)/],
  ["autolink", /^<((?:https?:\/\/|mailto:)[^\s<>]{1,2048})>/i],
  ["image", /^!\[([^\]]{0,300})\]\(\s*<?([^\s()<>]{0,2048})>?(?:\s+"[^"]{0,300}")?\s*\)/],
  ["link", /^\[((?:[^\[\]]|\[[^\]]{0,300}\]){0,300})\]\(\s*<?([^\s()<>]{0,2048})>?(?:\s+"([^"]{0,300})")?\s*\)/],
  ["strong", /^(\*\*|__)(?=\S)([\s\S]{0,400}?\S)\1/],
  ["strike", /^~~(?=\S)([\s\S]{0,400}?\S)~~/],
  ["em", /^(\*|_)(?=\S)([\s\S]{0,400}?\S)\1(?![*_])/],
  ["url", /^https?:\/\/[^\s<>()]{0,2048}[^\s<>().,;:!?'"]/],
  ["break", /^ {2,}\n|^\\\n/],
  ["escape", /^\\([!-\/:-@\[-`{-~])/],
];

export function renderInline(text, parent, depth = 0) {
  let buf = "";
  const flush = () => {
    if (buf) parent.append(document.createTextNode(buf));
    buf = "";
  };
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    if ("`<![*_~h\\ ".includes(c) && depth < 8) {
      const rest = text.slice(i);
      let matched = false;
      for (const [kind, re] of INLINE) {
        const m = re.exec(rest);
        if (!m) continue;
        if (kind === "url" && i > 0 && /\w/.test(text[i - 1])) continue;
        if (kind === "em" && m[1] === "_" && i > 0 && /\w/.test(text[i - 1])) continue;
        flush();
        matched = true;
        i += m[0].length;
        if (kind === "code") {
          const code = h("code");
          code.textContent = m[2].replace(/^ (.*) $/s, "$1");
          parent.append(code);
        } else if (kind === "autolink" || kind === "url") {
          appendLink(parent, m[kind === "url" ? 0 : 1], null, depth);
        } else if (kind === "image") {
          const span = h("span", "md-image");
          span.textContent = "[image" + (m[1] ? ": " + m[1] : "") + (m[2] ? " — " + m[2] : "") + " (not loaded)]";
          parent.append(span);
        } else if (kind === "link") {
          appendLink(parent, m[2], m[1], depth, m[3]);
        } else if (kind === "strong" || kind === "em" || kind === "strike") {
          const n = h(kind === "strike" ? "del" : kind);
          renderInline(kind === "strike" ? m[1] : m[2], n, depth + 1);
          parent.append(n);
        } else if (kind === "break") {
          parent.append(h("br"));
        } else if (kind === "escape") {
          buf += m[1];
        }
        break;
      }
      if (matched) continue;
    }
    buf += c;
    i++;
  }
  flush();
}

function appendLink(parent, href, label, depth, title) {
  const safe = safeHref(href);
  if (!safe) {
    // an unsafe or relative target: the label (or the address) as text only
    if (label !== null && label !== undefined) renderInline(label, parent, depth + 1);
    else parent.append(document.createTextNode(href));
    return;
  }
  const a = h("a");
  a.href = safe;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  a.referrerPolicy = "no-referrer";
  if (title) a.title = title;
  if (label !== null && label !== undefined) renderInline(label, a, depth + 1);
  else a.textContent = href;
  parent.append(a);
}

// ---- blocks ----
const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const HR = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])[ \t]+(.*)$/;
const TABLE_SEP = /^ *\|? *:?-+:? *(\| *:?-+:? *)*\|? *$/;

function splitRow(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

export function renderMarkdown(text, { onCode } = {}) {
  const root = document.createDocumentFragment();
  renderBlocks(String(text || "").replace(/\r\n?/g, "\n").split("\n"), root, 0, onCode);
  return root;
}

function renderBlocks(lines, parent, depth, onCode) {
  let i = 0;
  let para = [];
  const endPara = () => {
    if (!para.length) return;
    const p = h("p");
    renderInline(para.join("\n"), p);
    parent.append(p);
    para = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      endPara();
      i++;
      continue;
    }
    if ((m = FENCE.exec(line))) {
      endPara();
      const fence = m[1];
      const lang = m[2] || "";
      const body = [];
      i++;
      while (i < lines.length && !new RegExp("^ {0,3}" + fence[0] + "{" + fence.length + ",}\\s*$").test(lines[i])) body.push(lines[i++]);
      i++; // the closing fence (or the end: a block still streaming in)
      parent.append(codeBlock(body.join("\n"), lang, onCode));
      continue;
    }
    if ((m = HEADING.exec(line))) {
      endPara();
      const n = h("h" + Math.min(6, m[1].length + 2)); // h3..h6 inside a message
      renderInline(m[2] || "", n);
      parent.append(n);
      i++;
      continue;
    }
    if (HR.test(line) && !para.length) {
      parent.append(h("hr"));
      i++;
      continue;
    }
    if (QUOTE.test(line) && depth < 6) {
      endPara();
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        inner.push(m[1]);
        i++;
      }
      const q = h("blockquote");
      renderBlocks(inner, q, depth + 1, onCode);
      parent.append(q);
      continue;
    }
    if ((m = ITEM.exec(line)) && depth < 6) {
      endPara();
      i = renderList(lines, i, parent, depth, onCode);
      continue;
    }
    if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      endPara();
      const table = h("table", "md-table");
      const head = h("thead");
      const tr = h("tr");
      for (const cell of splitRow(line)) {
        const th = h("th");
        renderInline(cell, th);
        tr.append(th);
      }
      head.append(tr);
      table.append(head);
      const body = h("tbody");
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
        const r = h("tr");
        for (const cell of splitRow(lines[i])) {
          const td = h("td");
          renderInline(cell, td);
          r.append(td);
        }
        body.append(r);
        i++;
      }
      table.append(body);
      const wrap = h("div", "md-table-wrap");
      wrap.append(table);
      parent.append(wrap);
      continue;
    }
    if (/^ {4}/.test(line) && !para.length) {
      const body = [];
      while (i < lines.length && (/^ {4}/.test(lines[i]) || !lines[i].trim())) body.push(lines[i++].slice(4));
      while (body.length && !body[body.length - 1].trim()) body.pop();
      parent.append(codeBlock(body.join("\n"), "", onCode));
      continue;
    }
    para.push(line.trim() === line ? line : line.replace(/^ {1,3}/, ""));
    i++;
  }
  endPara();
}

function renderList(lines, i, parent, depth, onCode) {
  const first = ITEM.exec(lines[i]);
  const ordered = /\d/.test(first[2]);
  const list = h(ordered ? "ol" : "ul");
  if (ordered) {
    const start = parseInt(first[2], 10);
    if (start !== 1) list.start = start;
  }
  const indent = first[1].length;
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const content = [m[3]];
    const cont = m[1].length + m[2].length + 1;
    i++;
    while (i < lines.length) {
      const l = lines[i];
      if (!l.trim()) {
        // a blank line continues the item only when indented text follows
        if (i + 1 < lines.length && /^\s{2,}\S/.test(lines[i + 1])) { content.push(""); i++; continue; }
        break;
      }
      const n = ITEM.exec(l);
      if (n && n[1].length <= indent) break;
      if (/^\s/.test(l)) { content.push(l.replace(new RegExp("^ {0," + cont + "}"), "")); i++; continue; }
      if (n || FENCE.test(l) || HEADING.test(l) || QUOTE.test(l)) break;
      content.push(l); // a lazy continuation line
      i++;
    }
    const li = h("li");
    if (content.length === 1) renderInline(content[0], li);
    else renderBlocks(content, li, depth + 1, onCode);
    list.append(li);
  }
  parent.append(list);
  return i;
}

function codeBlock(code, lang, onCode) {
  const wrap = h("div", "code-block");
  const bar = h("div", "code-bar");
  const label = h("span", "code-lang");
  label.textContent = lang;
  bar.append(label);
  const btn = h("button", "copy-code");
  btn.type = "button";
  btn.textContent = "Copy";
  btn.addEventListener("click", () => {
    navigator.clipboard?.writeText(code).then(() => { btn.textContent = "Copied"; setTimeout(() => { btn.textContent = "Copy"; }, 1200); }, () => {});
  });
  bar.append(btn);
  const pre = h("pre");
  const c = h("code");
  if (lang) c.dataset.lang = lang;
  c.textContent = code;
  pre.append(c);
  wrap.append(bar, pre);
  if (onCode) onCode(wrap);
  return wrap;
}
