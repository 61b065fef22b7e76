// attnscope's explorer page, its drawing: the colour scale, cells painted one pixel each and drawn scaled with
// smoothing off (sharp at any zoom and pixel density), axis labels, hit-testing, the tooltip, the colour bar.

// ---- colours and drawing ----------------------------------------------------------------------------
function lut(anchors) {
  const out = new Uint8ClampedArray(256 * 3);
  for (let i = 0; i < 256; i++) {
    const pos = (i / 255) * (anchors.length - 1), lo = Math.min(Math.floor(pos), anchors.length - 2), t = pos - lo;
    for (let c = 0; c < 3; c++) out[i * 3 + c] = Math.round(anchors[lo][c] + (anchors[lo + 1][c] - anchors[lo][c]) * t);
  }
  return out;
}
function css(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }
const dpr = () => window.devicePixelRatio || 1;

// Paint rows x cols values (value(i, j), NaN allowed; scale(i) the row's top of the scale) into an
// offscreen canvas, one pixel a cell; drawn scaled with smoothing off, every cell stays a sharp block.
// skip(i, j): a cell drawn grey (an evicted key); hole(i, j): a cell left clear, for the hatch under it to show.
function cells(rows, cols, value, scale, skip, hole) {
  const off = document.createElement("canvas");
  off.width = Math.max(cols, 1); off.height = Math.max(rows, 1);
  const ctx = off.getContext("2d"), img = ctx.createImageData(off.width, off.height), px = img.data;
  for (let i = 0; i < rows; i++) {
    const top = scale(i) || 1;
    for (let j = 0; j < cols; j++) {
      const o = (i * cols + j) * 4;
      if (skip && skip(i, j)) { px[o] = px[o + 1] = px[o + 2] = 128; px[o + 3] = 90; continue; }
      if (hole && hole(i, j)) continue;  // transparent
      const v = value(i, j);
      if (Number.isNaN(v)) { px[o] = 255; px[o + 1] = 0; px[o + 2] = 255; px[o + 3] = 255; continue; }
      const k = Math.max(0, Math.min(255, Math.round((v / top) * 255))) * 3;
      px[o] = LUT[k]; px[o + 1] = LUT[k + 1]; px[o + 2] = LUT[k + 2]; px[o + 3] = 255;
    }
  }
  ctx.putImageData(img, 0, 0);
  return off;
}

// The hatch of a masked key (the mask forbids it: its weight is 0 by construction, not merely small):
// diagonal lines on the page's background, in either theme, at the screen's pixels whatever the cell size.
function hatch(ctx) {
  const tile = document.createElement("canvas"), n = 6;
  tile.width = tile.height = n;
  const t = tile.getContext("2d");
  t.fillStyle = css("--masked-bg"); t.fillRect(0, 0, n, n);
  t.strokeStyle = css("--masked-line"); t.lineWidth = 1.2;
  t.beginPath(); t.moveTo(0, n); t.lineTo(n, 0); t.moveTo(-1, 1); t.lineTo(1, -1); t.moveTo(n - 1, n + 1); t.lineTo(n + 1, n - 1); t.stroke();
  return ctx.createPattern(tile, "repeat");
}

// Draw a cells() image at (x, y), w x h, sharp; where `hatched`, the hatch first, under the clear cells.
function paint(ctx, image, x, y, w, h, hatched) {
  if (hatched) { ctx.fillStyle = hatch(ctx); ctx.fillRect(x, y, w, h); }
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(image, x, y, w, h);
}

// A heatmap with labels on both axes. spec: rows, cols, rowLabel(i), colLabel(j), cell (css px), image,
// rowMark(i) ("sel" | "match" | ""), colMark(j), hatched (the image has clear masked cells). Returns the geometry
// for hit-testing.
function drawMap(canvas, spec) {
  const ratio = dpr(), font = "11px ui-monospace, 'DejaVu Sans Mono', Menlo, Consolas, monospace";
  let cell = spec.cell;
  const ctx = canvas.getContext("2d");
  ctx.font = font;
  const every = (c) => Math.max(1, Math.ceil(13 / c));
  const width = (labels, n, step) => { let w = 0; for (let i = 0; i < n; i += step) w = Math.max(w, ctx.measureText(labels(i)).width); return Math.min(w, 150); };
  const left = Math.ceil(width(spec.rowLabel, spec.rows, every(cell)) + 10);
  const top = Math.ceil(width(spec.colLabel, spec.cols, every(cell)) + 10);
  const limit = 16000 / ratio;  // canvases past 16k device pixels a side are refused by some browsers
  cell = Math.min(cell, (limit - left - 8) / Math.max(spec.cols, 1), (limit - top - 8) / Math.max(spec.rows, 1));
  const W = left + spec.cols * cell + 8, H = top + spec.rows * cell + 8;
  canvas.width = Math.round(W * ratio); canvas.height = Math.round(H * ratio);
  canvas.style.width = W + "px"; canvas.style.height = H + "px";
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.fillStyle = css("--bg"); ctx.fillRect(0, 0, W, H);
  paint(ctx, spec.image, left, top, spec.cols * cell, spec.rows * cell, spec.hatched);
  ctx.font = font; ctx.textBaseline = "middle";
  const fg = css("--fg"), accent = css("--accent"), match = css("--match");
  const step = every(cell);
  const clip = (s) => (s.length > 18 ? s.slice(0, 17) + "…" : s);
  for (let i = 0; i < spec.rows; i++) {
    const mark = spec.rowMark ? spec.rowMark(i) : "";
    if (i % step && !mark) continue;
    const y = top + (i + 0.5) * cell;
    if (mark === "match") { ctx.fillStyle = match; ctx.fillRect(0, y - 6, left - 4, 12); }
    ctx.fillStyle = mark === "sel" ? accent : fg;
    ctx.textAlign = "right";
    ctx.fillText(clip(spec.rowLabel(i)), left - 5, y);
  }
  for (let j = 0; j < spec.cols; j++) {
    const mark = spec.colMark ? spec.colMark(j) : "";
    if (j % step && !mark) continue;
    ctx.save();
    ctx.translate(left + (j + 0.5) * cell, top - 5);
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "left";
    if (mark === "match") { ctx.fillStyle = match; ctx.fillRect(-1, -6, top - 8, 12); }
    ctx.fillStyle = mark === "sel" ? accent : fg;
    ctx.fillText(clip(spec.colLabel(j)), 0, 0);
    ctx.restore();
  }
  for (const i of spec.outline || []) {
    ctx.strokeStyle = accent; ctx.lineWidth = 2;
    ctx.strokeRect(left - 1, top + i * cell - 1, spec.cols * cell + 2, cell + 2);
  }
  Object.assign(canvas.dataset, { left, top, cell });  // where the cells are, in CSS pixels (for tests)
  return { left, top, cell, rows: spec.rows, cols: spec.cols };
}

function hit(geo, event) {
  const r = event.target.getBoundingClientRect();
  const j = Math.floor((event.clientX - r.left - geo.left) / geo.cell), i = Math.floor((event.clientY - r.top - geo.top) / geo.cell);
  return i >= 0 && j >= 0 && i < geo.rows && j < geo.cols ? { i, j } : null;
}

// The row a click picks: its cells, or its label left of them (a label reads as the row's handle).
function rowAt(geo, event) {
  const at = hit(geo, event);
  if (at) return at.i;
  const r = event.target.getBoundingClientRect();
  const x = event.clientX - r.left, i = Math.floor((event.clientY - r.top - geo.top) / geo.cell);
  return x >= 0 && x < geo.left && i >= 0 && i < geo.rows ? i : null;
}

function showTip(tip, wrap, event, text) {
  tip.textContent = text; tip.hidden = false;
  const r = wrap.getBoundingClientRect();
  let x = event.clientX - r.left + wrap.scrollLeft + 14, y = event.clientY - r.top + wrap.scrollTop + 14;
  x = Math.min(x, wrap.scrollLeft + wrap.clientWidth - tip.offsetWidth - 4);
  tip.style.left = Math.max(0, x) + "px"; tip.style.top = y + "px";
}

function colorbar(max, exp, masked) {  // masked: a hatched swatch under it, "masked"
  const c = $("colorbar"), ratio = dpr(), W = 78, H = masked ? 256 : 220, ctx = c.getContext("2d");
  c.width = W * ratio; c.height = H * ratio; c.style.width = W + "px"; c.style.height = H + "px";
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, W, H);
  for (let y = 0; y < 200; y++) {
    const k = Math.round((1 - y / 199) * 255) * 3;
    ctx.fillStyle = `rgb(${LUT[k]},${LUT[k + 1]},${LUT[k + 2]})`;
    ctx.fillRect(4, 10 + y, 16, 1);
  }
  ctx.fillStyle = css("--fg"); ctx.font = "11px ui-monospace, monospace"; ctx.textBaseline = "middle";
  const d = Math.max(0, -exp);
  for (const f of [1, 0.75, 0.5, 0.25, 0]) ctx.fillText((max * f).toFixed(d), 24, 10 + (1 - f) * 199);
  if (masked) {
    ctx.fillStyle = hatch(ctx); ctx.fillRect(4, 228, 16, 16);
    ctx.strokeStyle = css("--line"); ctx.lineWidth = 1; ctx.strokeRect(4.5, 228.5, 15, 15);
    ctx.fillStyle = css("--fg"); ctx.fillText("masked", 24, 236);
  }
  c.dataset.masked = masked ? "1" : "";
}
