// attnscope's explorer page, over the image (head --image): the image the model read (META.image.uri, its
// processor's output), each patch painted with the chosen query's weight on it on the viridis scale (0 to the
// largest weight on a patch), the query's own patch outlined; click a patch to make it the query. The tokens
// that are no place on the image ([CLS], [DIST], registers) are listed apart with their weights, and pick a query
// too. With no query chosen the row shown is [CLS]'s, or, with no [CLS], every query's mean. With --all-layers a
// button switches to the attention rollout's row (META.rollout, readings/rollout.py) for the same query.

const OVERLAY_SIDE = 448, OVERLAY_ALPHA = 0.6;
let overlayImage = null, overlayGeo = null, overlayRollout = null;
let overlayStep = null;  // a VLM's --generate: the decode step picked on the timeline, shown until a query is picked

function overlayPick(i) {  // decode.js: a generated token's row (the query that chose it) over the image
  overlayStep = { i, query: state.query };
  drawOverlay();
}

function overlayRow() {  // [query or null, weights over every key, decode step or null]: the chosen query's, else
  // [CLS]'s, else the mean; a decode step picked after the query, its row
  if (overlayStep && overlayStep.query === state.query && decodeRows && decodeRows[overlayStep.i]) {
    const a = decodeRows[overlayStep.i], n = a.shape[1], h = Math.min(state.head, a.shape[0] - 1);
    return [null, Array.from({ length: n }, (_, j) => a.value(h * n + j)), overlayStep.i];
  }
  const I = META.image, q = state.query !== null ? state.query : (I.query ?? null);  // a VLM's: its last text query
  const R = overlayRollout, P = R ? { n_Q: R.shape[0], n_K: R.shape[1], row: (i) => ({ arr: R, base: i * R.shape[1] }) } : current;
  if (q !== null || I.prefix.includes("[CLS]")) {
    const at = q === null ? I.prefix.indexOf("[CLS]") : q, row = P.row(at);
    if (!row) return [at, null];
    return [at, Array.from({ length: P.n_K }, (_, j) => row.arr.value(row.base + j))];
  }
  const sum = new Float64Array(P.n_K);
  let n = 0;
  for (let i = 0; i < P.n_Q; i++) {
    const row = P.row(i);
    if (!row) continue;
    n += 1;
    for (let j = 0; j < P.n_K; j++) sum[j] += row.arr.value(row.base + j);
  }
  return [null, n ? Array.from(sum, (v) => v / n) : null];
}

function drawOverlay() {
  const I = META.image, box = $("image-overlay");
  if (!I || !current) return;
  box.hidden = false;
  if (!overlayImage) {
    overlayImage = new Image();
    overlayImage.onload = () => drawOverlay();
    overlayImage.src = I.uri;
    wireOverlay();
    const mode = $("overlay-mode");
    mode.hidden = !(META.rollout && META.rollout.rollout);
    mode.addEventListener("click", async () => {
      overlayRollout = overlayRollout ? null : await arr(META.rollout.rollout);
      mode.setAttribute("aria-pressed", String(!!overlayRollout));
      mode.textContent = overlayRollout ? "show the head" : "show the rollout";
      drawOverlay();
    });
    return;
  }
  if (!overlayImage.complete) return;
  const [q, weights, step] = overlayRow(), canvas = $("overlay-canvas"), ratio = dpr();
  const scale = OVERLAY_SIDE / Math.max(I.rows * I.patch, I.cols * I.patch), size = I.patch * scale;
  const W = I.cols * size, H = I.rows * size;
  canvas.width = Math.round(W * ratio); canvas.height = Math.round(H * ratio);
  canvas.style.width = W + "px"; canvas.style.height = H + "px";
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, W, H);
  ctx.drawImage(overlayImage, 0, 0, I.cols * I.patch, I.rows * I.patch, 0, 0, W, H);
  const patches = weights ? weights.slice(I.first, I.first + I.rows * I.cols) : [];
  const peak = patches.reduce((m, v) => (Number.isFinite(v) && v > m ? v : m), 0);
  patches.forEach((v, k) => {
    const f = peak > 0 && Number.isFinite(v) ? Math.min(1, v / peak) : 0, c = Math.round(f * 255) * 3;
    ctx.fillStyle = `rgba(${LUT[c]},${LUT[c + 1]},${LUT[c + 2]},${(OVERLAY_ALPHA * f).toFixed(3)})`;
    ctx.fillRect((k % I.cols) * size, Math.floor(k / I.cols) * size, size, size);
  });
  const own = q === null ? -1 : q - I.first;
  if (own >= 0 && own < I.rows * I.cols) {
    ctx.strokeStyle = "#fff"; ctx.lineWidth = 2;
    ctx.strokeRect((own % I.cols) * size + 1, Math.floor(own / I.cols) * size + 1, size - 2, size - 2);
  }
  overlayGeo = { size, q, weights, peak, decimals: 0 };
  const d = Math.max(0, -(overlayRollout ? overlayRollout.ref.exp : current.grid ? current.grid.ref.exp : -META.decimals));
  const onPatches = patches.reduce((s, v) => s + (Number.isFinite(v) ? v : 0), 0);
  const L = META.layers[state.layer], h = L.heads[state.head];
  const whose = overlayRollout ? `rollout up to ${META.layers[META.layers.length - 1].label}` : `${L.label}, ${h.label}`;
  const made = step == null ? null : META.decode.steps[step];
  const who = made ? `the row that chose new token ${made.position} “${made.token}”`
    : q === null ? "every query's mean" : `query ${q} “${qLabel(q)}”`;
  $("overlay-title").textContent = weights
    ? `${who}: ${onPatches.toFixed(3)} of its weight on the ${I.rows} × ${I.cols} patches; 0 (clear) to ${peak.toFixed(d)} (bright) · ${whose} · ${I.path}, ${I.processor}`
    : `${who}: its exact weights are not in the page, only the pooled pattern`;
  overlayGeo.decimals = d;
  overlayScale(W, weights ? peak : null, d);
  overlayPrefix(q, weights, d);
}

// The overlay's colour scale, under the image: the viridis colours at the overlay's opacity over the page's
// background (a patch paints its colour at OVERLAY_ALPHA x its share of the peak), 0 (clear) to the peak.
function overlayScale(W, peak, d) {
  const c = $("overlay-scale"), ratio = dpr(), H = 34, bar = 12, ctx = c.getContext("2d");
  c.width = Math.round(W * ratio); c.height = Math.round(H * ratio);
  c.style.width = W + "px"; c.style.height = H + "px";
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, W, H);
  c.hidden = peak === null;
  if (peak === null) return;
  const n = Math.max(1, Math.floor(W - 2));
  for (let x = 0; x < n; x++) {
    const f = x / (n - 1 || 1), k = Math.round(f * 255) * 3;
    ctx.fillStyle = css("--bg"); ctx.fillRect(1 + x, 2, 1, bar);
    ctx.fillStyle = `rgba(${LUT[k]},${LUT[k + 1]},${LUT[k + 2]},${(OVERLAY_ALPHA * f).toFixed(3)})`;
    ctx.fillRect(1 + x, 2, 1, bar);
  }
  ctx.strokeStyle = css("--line"); ctx.lineWidth = 1; ctx.strokeRect(0.5, 1.5, n + 1, bar + 1);
  ctx.fillStyle = css("--fg"); ctx.font = "11px ui-monospace, 'DejaVu Sans Mono', Menlo, Consolas, monospace";
  ctx.textBaseline = "top";
  ctx.textAlign = "left"; ctx.fillText("0 (clear)", 1, bar + 6);
  ctx.textAlign = "right"; ctx.fillText(`${peak.toFixed(d)} (the largest on a patch)`, W - 1, bar + 6);
  Object.assign(c.dataset, { min: "0", max: peak.toFixed(d), alpha: String(OVERLAY_ALPHA) });
}

function overlayPrefix(q, weights, d) {
  const I = META.image, panel = $("overlay-prefix");
  panel.replaceChildren();
  if (!I.prefix.length) {
    const p = document.createElement("p"); p.className = "muted";
    p.textContent = I.query != null ? "the text's tokens are no place on the image: find one (find a token) to see its row here"
      : "no [CLS] or registers: every token is a patch";
    panel.append(p);
    return;
  }
  const h = document.createElement("p"); h.textContent = "apart from the image:"; panel.append(h);
  I.prefix.forEach((name, i) => {
    const b = document.createElement("button");
    b.type = "button"; b.dataset.testid = "overlay-token"; b.dataset.index = i;
    b.textContent = `${name} ${weights ? weights[i].toFixed(d) : "?"}`;
    b.title = `make ${name} the query`;
    b.setAttribute("aria-pressed", String(q === i));
    b.addEventListener("click", () => select(i, true));
    panel.append(b);
  });
}

function overlayHit(e) {
  const I = META.image, r = $("overlay-canvas").getBoundingClientRect();
  if (!overlayGeo) return null;
  const c = Math.floor((e.clientX - r.left) / overlayGeo.size), row = Math.floor((e.clientY - r.top) / overlayGeo.size);
  return c >= 0 && c < I.cols && row >= 0 && row < I.rows ? { row, c, token: I.first + row * I.cols + c } : null;
}

function wireOverlay() {
  const canvas = $("overlay-canvas");
  canvas.addEventListener("click", (e) => { const at = overlayHit(e); if (at) select(at.token, true); });
  canvas.addEventListener("mousemove", (e) => {
    const at = overlayHit(e);
    if (!at || !overlayGeo.weights) { canvas.title = ""; return; }
    canvas.title = `${kLabel(at.token)}: ${overlayGeo.weights[at.token].toFixed(overlayGeo.decimals)} (click: make it the query)`;
  });
  canvas.addEventListener("keydown", (e) => {  // focused, the arrows walk the grid (the page's own keys elsewhere)
    const I = META.image, step = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] }[e.key];
    if (!step || e.ctrlKey || e.metaKey || e.altKey) return;
    e.preventDefault(); e.stopPropagation();
    const own = overlayGeo && overlayGeo.q !== null ? overlayGeo.q - I.first : -1;
    const [r, c] = own >= 0 && own < I.rows * I.cols ? [Math.floor(own / I.cols), own % I.cols] : [0, 0];
    const row = Math.max(0, Math.min(I.rows - 1, r + (own >= 0 ? step[0] : 0)));
    const col = Math.max(0, Math.min(I.cols - 1, c + (own >= 0 ? step[1] : 0)));
    select(I.first + row * I.cols + col, true);
  });
}
