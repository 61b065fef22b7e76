// attnscope's explorer page, the page itself: the selectors, the heatmap of the chosen head, a query's keys,
// the tokens and the search, every head and the statistics, every layer's kinds, themes, keys, and the start.

// ---- the explorer ----------------------------------------------------------------------------------------
const layerSelect = $("layer-select"), headSelect = $("head-select");
let current = null, geo = null;

function tokenText(list, i) { return list[i] === undefined ? String(i) : list[i]; }
function qLabel(i) { return tokenText(META.queries, i); }
function kLabel(j) { return tokenText(META.keys, j); }
function range(n, per, g) { const a = g * per, b = Math.min(n, a + per) - 1; return a === b ? String(a) : `${a}–${b}`; }

function autoCell(P) {
  const cols = P.grid.shape[1], avail = Math.max(240, $("explorer").clientWidth - 560);
  return Math.max(1, Math.min(26, avail / Math.max(cols, 1)));
}

function drawPattern() {
  const P = current;
  if (!P || !P.grid) return;
  const [rows, cols] = P.grid.shape, [pr, pc] = P.pool, pooled = !P.exact;
  const max = P.grid.max();
  const dropped = META.sparse && P.exact && P.masks ? (i, j) => P.masked(i, j) && j <= i + (META.offset || 0) : null;
  const image = cells(rows, cols, (i, j) => P.grid.value(i * cols + j), () => max, dropped, P.masks && P.masked);
  const selRow = state.query === null ? null : Math.floor(state.query / pr);
  const matches = new Set(state.matches);
  const cell = state.cell || autoCell(P);
  geo = drawMap($("heatmap"), {
    rows, cols, image, cell,
    rowLabel: (i) => (pooled ? range(P.n_Q, pr, i) : qLabel(i)),
    colLabel: (j) => (pooled ? range(P.n_K, pc, j) : kLabel(j)),
    rowMark: (i) => (i === selRow ? "sel" : !pooled && matches.has(i) ? "match" : ""),
    colMark: (j) => (!pooled && state.search && kLabel(j).toLowerCase().includes(state.search) ? "match" : ""),
    outline: selRow === null ? [] : [selRow], hatched: !!P.masks,
  });
  colorbar(max, P.grid.ref.exp, !!P.masks);
}

// A head's kind, and the second one it also fits ("first-token + induction", the terminal's words)
function kindText(h) {
  return h.kind_also ? `${h.kind} + ${h.kind_also}` : h.kind;
}

function patternTitle() {
  const L = META.layers[state.layer], h = L.heads[state.head], P = current;
  const parts = [`${L.label}, ${h.label}`];
  if (h.kind) parts.push(kindText(h));
  parts.push(`${P.n_Q} queries × ${P.n_K} keys`);
  if (!P.exact) parts.push(`pooled: each cell = ${P.pool[0]} queries × ${P.pool[1]} keys (mean over the queries of their total weight on the keys)`);
  parts.push(`0 (dark) to ${P.grid.max().toFixed(Math.max(0, -P.grid.ref.exp))} (bright)`);
  if (P.masks) parts.push("hatched: keys the mask forbids (weight 0 by construction; a dark cell is an allowed key's small weight)");
  if (META.pattern_note) parts.push(META.pattern_note);
  if (META.decimals_note) parts.push(META.decimals_note);
  $("pattern-title").textContent = parts.join(" · ");
}

function keyItem(row, j, max, masked) {
  const li = document.createElement("li");
  li.dataset.key = j;
  if (masked) { li.className = "masked"; li.title = "the mask forbids this key"; }
  const v = row.arr.value(row.base + j);
  li.innerHTML = '<span class="pos"></span><span class="tok"></span><span class="bar"><i></i></span><span class="w" data-testid="key-weight"></span>';
  li.children[0].textContent = "k" + j;
  const label = kLabel(j);
  li.children[1].textContent = label === "k" + j ? "" : label;
  li.children[1].title = label;
  li.children[2].firstChild.style.width = (Number.isNaN(v) ? 0 : Math.max(0, Math.min(1, v / (max || 1))) * 100) + "%";
  li.children[3].textContent = row.arr.text(row.base + j);
  return li;
}

function showKeys(panel, title, sub, row, n_K, showAll, onToggle, masked) {  // masked(j): the mask forbids key j
  panel.replaceChildren();
  const h = document.createElement("h4"); h.textContent = title; panel.append(h);
  const p = document.createElement("div"); p.className = "muted"; p.textContent = sub; panel.append(p);
  if (!row) { const m = document.createElement("p"); m.textContent = "this query's exact weights are not in the page, only the pooled pattern (hover its cells)"; panel.append(m); return; }
  const order = [];
  let max = 0;
  for (let j = 0; j < n_K; j++) { order.push(j); const v = row.arr.value(row.base + j); if (v > max) max = v; }
  const units = (j) => { const u = row.arr.units(row.base + j); return Number.isNaN(u) ? -Infinity : u; };
  // the strongest of the keys the query may see: a masked key (weight 0 by construction) never pads the list
  const allowed = order.filter((j) => !(masked && masked(j)));
  const top = allowed.slice().sort((a, b) => units(b) - units(a) || a - b).slice(0, TOP);
  if (max <= 0 && !order.some((j) => Number.isNaN(row.arr.units(row.base + j)))) {
    const m = document.createElement("p"); m.textContent = "this query attends to no key: every weight is 0"; panel.append(m);
  }
  const list = document.createElement("ol"); list.className = "top"; list.dataset.testid = "top-keys-list";
  for (const j of top) list.append(keyItem(row, j, max, masked && masked(j)));
  panel.append(list);
  if (allowed.length > top.length) {  // keys the top list leaves out: else "show all" would repeat it
    const b = document.createElement("button"); b.type = "button"; b.dataset.testid = "show-all";
    b.textContent = showAll ? "hide the full list" : `show all ${n_K} keys in sequence order (a)`;
    b.setAttribute("aria-expanded", String(showAll));
    b.addEventListener("click", onToggle);
    panel.append(b);
  }
  if (showAll && allowed.length > top.length) {
    const all = document.createElement("ol"); all.className = "all"; all.dataset.testid = "all-keys-list";
    for (const j of order) all.append(keyItem(row, j, max, masked && masked(j)));
    panel.append(all);
  }
}

function topKeys() {
  const panel = $("top-keys"), L = META.layers[state.layer], h = L.heads[state.head];
  if (state.query === null) {
    panel.replaceChildren();
    const p = document.createElement("p");
    p.textContent = "Click a query (a row of the heatmap, or a token below it) to list the keys it attends to most, with their exact weights.";
    panel.append(p);
    return;
  }
  const q = state.query, pos = q + (META.offset || 0);
  showKeys(panel, `query ${q} “${qLabel(q)}”${META.offset ? ` (position ${pos})` : ""}`,
    `${L.label}, ${h.label}: its strongest keys, weights to ${Math.max(0, -(current.grid ? current.grid.ref.exp : -META.decimals))} decimals`,
    current.row(q), current.n_K, state.showAll, () => { state.showAll = !state.showAll; topKeys(); }, (j) => current.masked(q, j));
}

function tokens() {
  const box = $("query-tokens");
  if (box.childElementCount !== META.queries.length) {
    box.replaceChildren();
    META.queries.forEach((t, i) => {
      const b = document.createElement("button");
      b.type = "button"; b.textContent = t; b.title = `query ${i}`; b.dataset.testid = "query-token"; b.dataset.index = i;
      b.setAttribute("aria-pressed", "false");
      b.addEventListener("click", () => select(i));
      box.append(b);
    });
  }
  const matches = new Set(state.matches);
  Array.from(box.children).forEach((b, i) => {
    b.setAttribute("aria-pressed", String(i === state.query));
    b.classList.toggle("match", matches.has(i));
    b.classList.toggle("exact", !!current && !current.exact && current.rows.has(i));
  });
}

function select(q, scroll) {
  state.query = q === null ? null : Math.max(0, Math.min(META.queries.length - 1, q));
  drawPattern(); topKeys(); tokens(); drawOverlay();
  if (scroll && state.query !== null) {
    const b = $("query-tokens").children[state.query];
    if (b) b.scrollIntoView({ block: "nearest" });
  }
}

let opening = 0;
async function open(li, hi) {  // the data first, then everything shown at once, so nothing mixes two heads
  li = Math.max(0, Math.min(META.layers.length - 1, li));
  hi = Math.max(0, Math.min(META.layers[li].heads.length - 1, hi));
  const ticket = ++opening, P = await pattern(li, hi);
  if (ticket !== opening) return;  // a later choice won
  const layerChanged = li !== state.layer || !headSelect.options.length;
  state.layer = li; state.head = hi; current = P;
  layerSelect.value = String(li);
  if (layerChanged) fillHeads();
  headSelect.value = String(hi);
  patternTitle(); drawPattern(); topKeys(); tokens(); stats(); heading(); kinds(); sinksView(); drawOverlay();
  document.documentElement.dataset.shown = `${li}:${hi}`;
  await grid(); await decode();
}

function heading() {  // the title names the layer and head shown; a table about another says whose it is
  const L = META.layers[state.layer], h = L.heads[state.head], shown = `${L.label}, ${h.label}`;
  if (META.subject) { $("page-title").textContent = META.subject + shown; document.title = META.subject + shown; }
  document.querySelectorAll("table.steps[data-layer]").forEach((t) => {
    const li = Number(t.dataset.layer), hi = t.dataset.head === undefined ? null : Number(t.dataset.head);
    const other = li !== state.layer || (hi !== null && hi !== state.head);
    let note = t.querySelector(".elsewhere-note");
    if (!note) { note = document.createElement("span"); note.className = "elsewhere-note"; note.dataset.testid = "elsewhere-note"; t.caption.append(note); }
    const about = META.layers[li].label + (hi === null ? "" : ", " + META.layers[li].heads[hi].label);
    note.textContent = other ? `this table is ${about}'s, as the run asked; the heatmap shows ${shown}` : "";
    note.hidden = !other;
    t.classList.toggle("elsewhere", other);
  });
}

// Every layer's heads as letters of their kinds (the terminal's --all-layers grid); a click opens that head.
function kinds() {
  const box = $("kinds"), table = $("kinds-grid");
  if (META.layers.length < 2 || !META.layers.some((L) => L.heads.some((h) => h.kind))) return;
  if (!table.rows.length) {
    const letters = META.kind_letters;
    $("kinds-legend").replaceChildren(...Object.entries(letters).flatMap(([kind, letter], i) => {
      const b = document.createElement("b"); b.textContent = letter;
      return [i ? "  " : "", b, " " + kind];
    }), "  (docs/heads.md)");
    const n = Math.max(...META.layers.map((L) => L.heads.length));
    const head = table.createTHead().insertRow();
    head.append(document.createElement("th"));
    for (let hi = 0; hi < n; hi++) { const th = document.createElement("th"); th.textContent = String(hi); th.scope = "col"; head.append(th); }
    const body = table.createTBody();
    META.layers.forEach((L, li) => {
      const tr = body.insertRow(), th = document.createElement("th");
      th.textContent = L.label; th.scope = "row"; tr.append(th);
      L.heads.forEach((h, hi) => {
        const td = tr.insertCell();
        td.textContent = h.kind ? letters[h.kind] || "?" : "";
        td.title = `${L.label}, ${h.label}${h.kind ? ": " + kindText(h) : ""}`;
        td.dataset.layer = li; td.dataset.head = hi; td.dataset.testid = "kind-cell";
      });
    });
    table.addEventListener("click", (e) => { const td = e.target.closest("td"); if (td) open(Number(td.dataset.layer), Number(td.dataset.head)); });
    box.hidden = false;
    document.querySelectorAll(".needs-layers").forEach((a) => { a.hidden = false; });
  }
  Array.from(table.tBodies[0].rows).forEach((tr, li) => {
    tr.classList.toggle("current", li === state.layer);
    tr.querySelectorAll("td").forEach((td) => td.classList.toggle("selected",  // the row's label is a th, not a head
      Number(td.dataset.layer) === state.layer && Number(td.dataset.head) === state.head));
  });
}

function fillHeads() {
  const heads = META.layers[state.layer].heads;
  headSelect.replaceChildren(...heads.map((h, i) => new Option(h.kind ? `${h.label} · ${kindText(h)}` : h.label, String(i))));
  $("heads-layer").textContent = META.layers[state.layer].label;
}

async function grid() {
  const box = $("head-grid"), li = state.layer, heads = META.layers[li].heads;
  if (box.dataset.layer !== String(li)) {
    box.dataset.layer = String(li);
    box.replaceChildren();
    for (let hi = 0; hi < heads.length; hi++) {
      const h = heads[hi], b = document.createElement("button");
      b.type = "button"; b.className = "thumb"; b.dataset.testid = "head-thumb"; b.dataset.head = hi;
      const c = document.createElement("canvas"), cap = document.createElement("span");
      cap.textContent = h.kind ? `${h.label}: ${kindText(h)}` : h.label;
      b.append(c, cap);
      b.addEventListener("click", () => open(li, hi));
      box.append(b);
      thumb(c, await pattern(li, hi));
      if (state.layer !== li) return;
    }
  }
  Array.from(box.children).forEach((b, i) => b.setAttribute("aria-pressed", String(i === state.head)));
}

function thumb(canvas, P) {  // pooled to at most 48 cells a side, keys summed and queries averaged, each row on its own scale
  if (!P.grid) return;
  const [R, C] = P.grid.shape, r = Math.ceil(R / 48), c = Math.ceil(C / 48), rows = Math.ceil(R / r), cols = Math.ceil(C / c);
  const sums = new Float64Array(rows * cols), counts = new Float64Array(rows), seen = new Uint8Array(rows * cols);
  for (let i = 0; i < R; i++) {
    counts[Math.floor(i / r)] += 1;
    for (let j = 0; j < C; j++) {
      const v = P.grid.value(i * C + j), at = Math.floor(i / r) * cols + Math.floor(j / c);
      sums[at] += v;
      if (!P.masked(i, j)) seen[at] = 1;  // a thumbnail's cell is masked when every key in it is
    }
  }
  const top = new Float64Array(rows);
  for (let i = 0; i < rows; i++) for (let j = 0; j < cols; j++) { sums[i * cols + j] /= counts[i]; if (sums[i * cols + j] > top[i]) top[i] = sums[i * cols + j]; }
  const image = cells(rows, cols, (i, j) => sums[i * cols + j], (i) => top[i], null, P.masks && ((i, j) => !seen[i * cols + j]));
  const px = Math.max(2, Math.min(8, Math.floor(128 / Math.max(rows, cols)))), ratio = dpr();
  canvas.width = cols * px * ratio; canvas.height = rows * px * ratio;
  canvas.style.width = cols * px + "px"; canvas.style.height = rows * px + "px";
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  paint(ctx, image, 0, 0, cols * px, rows * px, !!P.masks);
}

const STATS = [["entropy", "entropy (bits)", 2], ["first", "first token", 2], ["previous", "previous", 2], ["self", "self", 2], ["distance", "distance", 1], ["spread", "spread", 2]];
// a vision tower's patch grid (readings/gridstats.py, docs/heads.md): its figures over patch queries in place of
// previous and the distance in positions; the special tokens' columns where the model has them
const GRID_STATS = [["entropy", "entropy (bits)", 2], ["grid_cls", "[CLS]", 2], ["grid_distillation", "[DIST]", 2], ["grid_registers", "registers", 2], ["grid_self", "self", 2], ["grid_row", "row", 2], ["grid_column", "column", 2], ["grid_neighbours", "8 nbrs", 2], ["grid_distance", "distance (patches)", 1], ["spread", "spread", 2]];
const SPECIAL = ["grid_cls", "grid_distillation", "grid_registers"];
const GRID_ABOUT = "(docs/heads.md: over patch queries, mean weight on [CLS] and registers, the own patch, the rest of its row and column, the 8 neighbours; mean distance of the weight on patches, in patches; entropy in bits)";
const onGrid = (heads) => heads.some((h) => h.stats && h.stats.grid_tower);
function statColumns(heads) {
  const has = (k) => heads.some((h) => h.stats && h.stats[k] !== null && h.stats[k] !== undefined);
  if (onGrid(heads)) return GRID_STATS.filter(([k]) => !SPECIAL.includes(k) || has(k));
  return has("grid_text_to_image") ? [...STATS, ["grid_text_to_image", "image", 2]] : STATS;  // a VLM's text on its image
}
function stats() {
  const table = $("head-stats"), heads = META.layers[state.layer].heads;
  const known = heads.some((h) => h.stats);
  table.hidden = !known;
  if (!known) return;
  const columns = statColumns(heads), about = $("stats-about");
  if (!about.dataset.text) about.dataset.text = about.textContent;  // a text's words, kept for its layers
  about.textContent = onGrid(heads) ? GRID_ABOUT : columns === STATS ? about.dataset.text :
    about.dataset.text.replace(/\)$/, "; image: the text's mean weight on the image's tokens)");  // a VLM's prompt
  const head = document.createElement("thead"), tr = document.createElement("tr");
  for (const [text, cls] of [["head", "num"], ["kind", "text"], ...columns.map((s) => [s[1], "num"])]) {
    const th = document.createElement("th"); th.textContent = text; th.className = cls; th.scope = "col"; tr.append(th);
  }
  head.append(tr);
  const body = document.createElement("tbody");
  heads.forEach((h, i) => {
    const row = document.createElement("tr");
    row.className = "clickable" + (i === state.head ? " selected" : ""); row.tabIndex = 0;
    const cellsOf = [[h.head === null ? "-" : String(h.head), "num"], [h.kind ? kindText(h) : "", "text"],
      ...columns.map(([k, , d]) => [h.stats && h.stats[k] !== null && h.stats[k] !== undefined ? h.stats[k].toFixed(d) : k.startsWith("grid_") ? "-" : "nan", "num"])];
    for (const [text, cls] of cellsOf) { const td = document.createElement("td"); td.textContent = text; td.className = cls; row.append(td); }
    row.addEventListener("click", () => open(state.layer, i));
    row.addEventListener("keydown", (e) => { if (e.key === "Enter") open(state.layer, i); });
    body.append(row);
  });
  table.replaceChildren(head, body);
}

// ---- events --------------------------------------------------------------------------------------------
function setTheme(theme) {
  document.documentElement.dataset.theme = theme;
  $("theme-toggle").textContent = theme === "dark" ? "light" : "dark";
  try { localStorage.setItem("attnscope-theme", theme); } catch (e) { /* storage may be off (a sandboxed frame) */ }
  redraw();
}

function redraw() {
  if (!current) return;
  drawPattern();
  const box = $("head-grid");
  box.dataset.layer = "";
  grid();
  decode();
  drawOverlay();  // its colour scale is drawn over the theme's background
}

function search(text) {
  state.search = text.trim().toLowerCase();
  state.matches = state.search ? META.queries.map((t, i) => [t.toLowerCase(), i]).filter(([t]) => t.includes(state.search)).map(([, i]) => i) : [];
  $("search-count").textContent = state.search ? `${state.matches.length} of ${META.queries.length} tokens` : "";
  drawPattern(); tokens();
}

function wire() {
  layerSelect.addEventListener("change", () => open(Number(layerSelect.value), state.head));
  headSelect.addEventListener("change", () => open(state.layer, Number(headSelect.value)));
  const input = $("token-search");
  input.addEventListener("input", () => search(input.value));
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && state.matches.length) {
      const next = state.matches.find((i) => state.query === null || i > state.query);
      select(next === undefined ? state.matches[0] : next, true);
    } else if (e.key === "Escape") { input.value = ""; search(""); input.blur(); }
  });
  const canvas = $("heatmap"), wrap = $("heatmap-wrap"), tip = $("tooltip");
  canvas.addEventListener("mousemove", (e) => {
    const at = geo && hit(geo, e);
    if (!at || !current) { tip.hidden = true; return; }
    const { i, j } = at, cols = current.grid.shape[1];
    const dropped = META.sparse && current.exact && j <= i + (META.offset || 0);  // causal, so the indexer dropped it
    const why = dropped ? "not selected by the sparse indexer" : "masked (the mask forbids this key)";
    const text = current.masked(i, j) ? why : current.grid.text(i * cols + j);
    if (current.exact) showTip(tip, wrap, e, `query ${i} “${qLabel(i)}” → key ${j} “${kLabel(j)}”: ${text}`);
    else showTip(tip, wrap, e, `queries ${range(current.n_Q, current.pool[0], i)} → keys ${range(current.n_K, current.pool[1], j)}: ${text}`);
  });
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  canvas.addEventListener("click", (e) => { const i = geo ? rowAt(geo, e) : null; if (i !== null) select(i * current.pool[0], true); });
  const dc = $("decode-canvas"), dtip = $("decode-tooltip");
  dc.addEventListener("mousemove", (e) => {
    const at = decodeGeo && hit(decodeGeo, e);
    if (!at || at.j >= decodeRows[at.i].shape[1]) { dtip.hidden = true; return; }
    const s = META.decode.steps[at.i], n = decodeRows[at.i].shape[1];
    showTip(dtip, dc.parentElement, e, `“${s.token}” @${s.position} → key ${at.j} “${decodeGeo.keys(at.j)}”: ${decodeRows[at.i].text(decodeGeo.h * n + at.j)}`);
  });
  dc.addEventListener("mouseleave", () => { dtip.hidden = true; });
  dc.addEventListener("click", (e) => { const i = decodeGeo ? rowAt(decodeGeo, e) : null; if (i !== null) decodePick(i); });
  $("zoom-in").addEventListener("click", () => zoom(1.25));
  $("zoom-out").addEventListener("click", () => zoom(0.8));
  $("zoom-fit").addEventListener("click", () => { state.cell = null; drawPattern(); });
  $("theme-toggle").addEventListener("click", () => setTheme(document.documentElement.dataset.theme === "dark" ? "light" : "dark"));
  let pending = false;
  window.addEventListener("resize", () => { if (!pending) { pending = true; requestAnimationFrame(() => { pending = false; redraw(); }); } });
  document.addEventListener("keydown", keys);
}

function zoom(f) {
  if (!current) return;
  state.cell = Math.max(1, Math.min(64, (state.cell || autoCell(current)) * f));
  drawPattern();
}

function keys(e) {
  const t = e.target, typing = t && (t.tagName === "INPUT" || t.tagName === "SELECT" || t.tagName === "TEXTAREA");
  if (typing || e.ctrlKey || e.metaKey || e.altKey || !current) return;
  const n = META.queries.length, q = state.query;
  const act = {
    ArrowDown: () => select(q === null ? 0 : q + 1, true), j: () => select(q === null ? 0 : q + 1, true),
    ArrowUp: () => select(q === null ? n - 1 : q - 1, true), k: () => select(q === null ? n - 1 : q - 1, true),
    ArrowRight: () => open(state.layer, state.head + 1), l: () => open(state.layer, state.head + 1),
    ArrowLeft: () => open(state.layer, state.head - 1), h: () => open(state.layer, state.head - 1),
    PageDown: () => open(state.layer + 1, state.head), "]": () => open(state.layer + 1, state.head),
    PageUp: () => open(state.layer - 1, state.head), "[": () => open(state.layer - 1, state.head),
    "/": () => $("token-search").focus(), "+": () => zoom(1.25), "=": () => zoom(1.25), "-": () => zoom(0.8),
    0: () => { state.cell = null; drawPattern(); }, a: () => { state.showAll = !state.showAll; topKeys(); decodeKeys(); },
    t: () => setTheme(document.documentElement.dataset.theme === "dark" ? "light" : "dark"),
    "?": () => { $("how").open = !$("how").open; },
  }[e.key];
  if (act) { e.preventDefault(); act(); }
}

function postHeight() {  // inside a notebook's frame: tell it how tall the page is
  if (window.parent !== window) window.parent.postMessage({ attnscopeHeight: document.documentElement.scrollHeight }, "*");
}

async function start() {
  let theme = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
  try { theme = localStorage.getItem("attnscope-theme") || theme; } catch (e) { /* storage may be off */ }
  document.documentElement.dataset.theme = theme;
  $("theme-toggle").textContent = theme === "dark" ? "light" : "dark";
  document.querySelectorAll(".needs-pattern").forEach((a) => { a.hidden = !META.layers.length; });
  document.querySelectorAll(".needs-decode").forEach((a) => { a.hidden = !META.decode; });
  if (META.layers.length) {
    if (typeof DecompressionStream !== "function") {
      const p = document.createElement("p"); p.className = "error";
      p.textContent = "This browser cannot read the page's packed data (it needs DecompressionStream: Chrome 80, Firefox 113, Safari 16.4 or later).";
      $("explorer").replaceChildren(p); $("explorer").hidden = false; return;
    }
    $("layer-axis").textContent = META.axis;
    if (META.axis !== "layer") {  // rows of the kinds grid are batch elements (sdpa, mha, trace): say so
      const plural = META.axis + "s";
      $("layers").firstChild.textContent = `every ${META.axis}, every head `;
      document.querySelector('a[href="#layers"]').textContent = `every ${META.axis}`;
      $("kinds-grid").setAttribute("aria-label", `every ${META.axis}'s heads by kind: rows are ${plural}, columns are heads`);
    }
    layerSelect.replaceChildren(...META.layers.map((L, i) => new Option(L.label, String(i))));
    $("explorer").hidden = false;
    wire();
    await open(META.focus[0], META.focus[1]);
    await rolloutView();  // readings.js
  }
  document.documentElement.dataset.ready = "1";
  window.attnscopeReady = performance.now();
  postHeight();
  new ResizeObserver(postHeight).observe(document.body);
}

start().catch((err) => {
  const p = document.createElement("p"); p.className = "error"; p.dataset.testid = "error";
  p.textContent = "The page could not draw its data: " + err;
  document.querySelector("main").prepend(p);
  document.documentElement.dataset.ready = "error";
});
