// attnscope's explorer page, the decode timeline: one row per generated token, its attention row for the chosen
// head (keys evicted from the cache hatched), a table of the steps, a step's strongest keys on a click.

// ---- decode timeline ----------------------------------------------------------------------------------
let decodeGeo = null, decodeRows = null;
async function decode() {
  const D = META.decode;
  if (!D || !D.steps.length) return;
  $("decode").hidden = false;
  const steps = D.steps, hi = state.head;
  decodeRows = [];
  for (const s of steps) decodeRows.push(await arr(s.attention));
  const n_head = decodeRows[0].shape[0];
  const h = Math.min(hi, n_head - 1);
  const cols = Math.max(...decodeRows.map((a) => a.shape[1]));
  const keys = (j) => (j < META.keys.length ? kLabel(j) : (steps.find((s) => s.position === j) || { token: String(j) }).token);
  const tops = decodeRows.map((a) => { let m = 0; const n = a.shape[1]; for (let j = 0; j < n; j++) m = Math.max(m, a.value(h * n + j) || 0); return m; });
  const evicted = (i, j) => j >= decodeRows[i].shape[1] || steps[i].evicted.some(([a, b]) => j >= a && j < b);
  const image = cells(steps.length, cols, (i, j) => (j < decodeRows[i].shape[1] ? decodeRows[i].value(h * decodeRows[i].shape[1] + j) : 0), (i) => tops[i],
    (i, j) => evicted(i, j));
  $("decode-title").textContent = `(${D.layer === null || D.layer === undefined ? "" : "layer " + D.layer + ", "}head ${h}; ${steps.length} new tokens)`;
  decodeGeo = drawMap($("decode-canvas"), {
    rows: steps.length, cols, image, cell: Math.max(3, Math.min(18, ($("explorer").clientWidth - 600) / cols)),
    rowLabel: (i) => `${steps[i].token} @${steps[i].position}`, colLabel: keys,
    rowMark: (i) => (i === state.decodeStep ? "sel" : ""), outline: state.decodeStep === null ? [] : [state.decodeStep],
  });
  decodeGeo.keys = keys; decodeGeo.h = h;
  const table = $("decode-table");
  const head = document.createElement("thead");
  head.innerHTML = "<tr><th class='num'>step</th><th class='text'>token</th><th class='num'>id</th><th class='num'>position</th><th class='num'>keys</th><th class='num'>KV cache</th></tr>";
  const body = document.createElement("tbody");
  steps.forEach((s, i) => {
    const tr = document.createElement("tr");
    tr.className = "clickable" + (i === state.decodeStep ? " selected" : ""); tr.tabIndex = 0;
    for (const [text, cls] of [[String(i), "num"], [s.token, "text"], [String(s.token_id), "num"], [String(s.position), "num"], [String(decodeRows[i].shape[1]), "num"], [s.kv_cache, "num"]]) {
      const td = document.createElement("td"); td.textContent = text; td.className = cls; tr.append(td);
    }
    tr.addEventListener("click", () => decodePick(i));
    body.append(tr);
  });
  table.replaceChildren(head, body);
  decodeKeys();
}

async function decodePick(i) { state.decodeStep = i; await decode(); if (META.image) overlayPick(i); }

function decodeKeys() {
  const panel = $("decode-keys"), i = state.decodeStep;
  if (i === null || !decodeRows) { panel.textContent = "Click a row (a generated token) for the keys it attends to most."; return; }
  const s = META.decode.steps[i], a = decodeRows[i], n = a.shape[1];
  showKeys(panel, `step ${i}: “${s.token}” at position ${s.position}`, `head ${decodeGeo.h}: its strongest keys`,
    { arr: a, base: decodeGeo.h * n }, n, state.showAll, () => { state.showAll = !state.showAll; decodeKeys(); });
  panel.querySelectorAll("li").forEach((li) => { li.children[1].textContent = decodeGeo.keys(Number(li.dataset.key)); });
}
