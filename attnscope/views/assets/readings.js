// attnscope's explorer page, the readings (readings/sinkshare.py, readings/rollout.py; docs/heads.md): the sinks
// view, a layer x head grid of where each head parks its weight and what moves from there, and the rollout: for a
// query picked, the share of each input token in what reaches it across the layers.

const SINK_MEASURES = [
  ["parked", "weight on the first token + the learned sink"],
  ["first", "weight on the first token"],
  ["sink", "weight on the learned sink (it moves nothing)"],
  ["weighted_first", "value-weighted share from the first token (what moves from there)"],
  ["top", "weight on the 3 keys with the most weight"],
  ["weighted_top", "value-weighted share from the 3 keys that move the most"],
];
const ROLLOUTS = [["rollout", "the attention"], ["rollout_weighted", "the value-weighted attention"],
  ["rollout_without_first", "the attention, the first token left out"]];  // --all-layers' rollout_without_first
const readingState = { showAll: false };

// key 0 in the measures' words: on a vision tower's tokens, which are no text, the token there by its label ("[CLS]
// (token 0)", SigLIP's "p(0,0) (token 0)"); on Whisper's encoder positions, audio labelled by time ("0.00s"), the
// audio there ("the audio at 0.00s (position 0)"), as render/readings.py's first_words says it in the terminal
function firstToken() {
  const audio = META.keys.length && kLabel(0) === "0.00s" && META.keys.every((_, j) => /^\d+\.\d\ds$/.test(kLabel(j)));
  if (audio) return "the audio at 0.00s (position 0)";
  return META.layers.some((L) => onGrid(L.heads)) && META.keys.length ? `${kLabel(0)} (token 0)` : "the first token";
}

function sinkValue(S, key, li, hi) {
  const v = key === "parked" ? S.first[li][hi] + S.sink[li][hi] : S[key][li][hi];
  return v === null || v === undefined ? NaN : v;
}

function sinkTitle(S, key, li, hi) {
  const L = META.layers[li], h = L.heads[hi], v = sinkValue(S, key, li, hi);
  const keys = key === "top" ? S.top_keys : key === "weighted_top" ? S.weighted_top_keys : null;
  const named = keys ? "; keys " + keys[li][hi].map((j) => `${j} “${kLabel(j)}”`).join(", ") : "";
  return `${L.label}, ${h.label}: ${Number.isNaN(v) ? "not finite" : v.toFixed(4)}${named}`;
}

function fillSinks() {
  const S = META.sinks, key = $("sinks-measure").value, table = $("sinks-grid");
  table.replaceChildren();
  const n = Math.max(...S.first.map((row) => row.length));
  const head = table.createTHead().insertRow();
  head.append(document.createElement("th"));
  for (let hi = 0; hi < n; hi++) { const th = document.createElement("th"); th.textContent = String(hi); th.scope = "col"; head.append(th); }
  const body = table.createTBody();
  S.first.forEach((row, li) => {
    const tr = body.insertRow(), th = document.createElement("th");
    th.textContent = META.layers[li].label; th.scope = "row"; tr.append(th);
    row.forEach((_, hi) => {
      const td = tr.insertCell(), v = sinkValue(S, key, li, hi);
      const k = Math.max(0, Math.min(255, Math.round((Number.isNaN(v) ? 0 : v) * 255))) * 3;
      td.textContent = Number.isNaN(v) ? "?" : String(Math.round(v * 100));
      td.style.background = `rgb(${LUT[k]}, ${LUT[k + 1]}, ${LUT[k + 2]})`;
      td.style.color = k > 150 * 3 ? "#000" : "#fff";
      td.title = sinkTitle(S, key, li, hi);
      td.dataset.layer = li; td.dataset.head = hi; td.dataset.testid = "sink-cell"; td.dataset.value = String(v);
    });
  });
  markSinks();
}

function markSinks() {
  const table = $("sinks-grid");
  if (!table.tBodies.length) return;
  Array.from(table.tBodies[0].rows).forEach((tr, li) => {
    tr.classList.toggle("current", li === state.layer);
    tr.querySelectorAll("td").forEach((td, hi) => td.classList.toggle("picked", li === state.layer && hi === state.head));
  });
}

function sinksView() {  // called each time a head opens: built once, then the head shown is outlined
  const S = META.sinks, select = $("sinks-measure");
  if (!S || !S.first || !S.first.length || S.first.length !== META.layers.length) return;
  if (!select.options.length) {
    const measures = SINK_MEASURES.filter(([key]) => (key === "parked" ? !!S.sink : !!S[key]));
    const first = firstToken();
    select.replaceChildren(...measures.map(([key, text]) => new Option(text.replace("the first token", first), key)));
    select.value = measures[0][0];
    select.addEventListener("change", fillSinks);
    $("sinks-grid").addEventListener("click", (e) => {
      const td = e.target.closest("td");
      if (td) open(Number(td.dataset.layer), Number(td.dataset.head));
    });
    $("sinks").hidden = false;
    document.querySelectorAll(".needs-sinks").forEach((a) => { a.hidden = false; });
    fillSinks();
  }
  markSinks();
}

async function drawRollout() {
  const name = $("rollout-kind").value, R = await arr(META.rollout[name]), q = Number($("rollout-row").value);
  const n_K = R.shape[1], last = META.layers[META.layers.length - 1];
  const what = ROLLOUTS.find(([k]) => k === name)[1];
  showKeys($("rollout-bars"), `query ${q} “${qLabel(q)}”`,
    `its input tokens by rollout of ${what}, ${META.layers[0].label} up to ${last.label}, to ${Math.max(0, -R.ref.exp)} decimals`,
    { arr: R, base: q * n_K }, n_K, readingState.showAll,
    () => { readingState.showAll = !readingState.showAll; drawRollout(); }, null);
}

async function rolloutView() {  // once: the row picker on the last query, the plain rollout first
  const R = META.rollout;
  if (!R || !R.rollout) return;
  const row = $("rollout-row"), kind = $("rollout-kind");
  row.replaceChildren(...META.queries.map((t, i) => new Option(`${i} ${t}`, String(i))));
  row.value = String(META.queries.length - 1);
  kind.replaceChildren(...ROLLOUTS.filter(([k]) => R[k]).map(([k, text]) => new Option(text, k)));
  row.addEventListener("change", drawRollout);
  kind.addEventListener("change", drawRollout);
  $("rollout").hidden = false;
  document.querySelectorAll(".needs-rollout").forEach((a) => { a.hidden = false; });
  await drawRollout();
}
