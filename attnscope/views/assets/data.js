// attnscope's explorer page: draws the run's attention from the data inline in this page (views/explorer.py).
// No library, no request: the numbers are read from the page's data elements, inflated with the browser's own
// DecompressionStream and drawn on canvases. A weight is stored as whole units of 10^exp (views/packing.py) and
// written from that integer, so what is shown is the run's weight rounded to the decimals shown.
// This part: the data (views/packing.py's format read back) and a head's pattern. The page's script is
// data.js, draw.js, decode.js and explorer.js joined in one function scope (views/explorer.py).

const $ = (id) => document.getElementById(id);
const META = JSON.parse($("attnscope-meta").textContent);
const NOT_FINITE = 65535;
const TOP = 10;
const state = { layer: 0, head: 0, query: null, cell: null, showAll: false, search: "", matches: [], decodeStep: null };
const groups = new Map();
const LUT = lut(META.viridis);

// ---- data -------------------------------------------------------------------------------------------
function bytesOf(text) {
  if (typeof Uint8Array.fromBase64 === "function") return Uint8Array.fromBase64(text.trim());
  const s = atob(text.trim());
  const out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}

function group(name) {
  if (!groups.has(name)) {
    groups.set(name, (async () => {
      const stream = new Blob([bytesOf($("attnscope-" + name).textContent)]).stream()
        .pipeThrough(new DecompressionStream("deflate"));
      const raw = new Uint8Array(await new Response(stream).arrayBuffer());
      const n = raw.length >> 1, out = new Uint16Array(n);
      for (let i = 0; i < n; i++) out[i] = raw[i] | (raw[n + i] << 8);
      return out;
    })());
  }
  return groups.get(name);
}

class Arr {  // one stored array: q[k] whole units, value = (lo + q) * 10^exp
  constructor(ref, all) {
    this.ref = ref;
    this.shape = ref.shape;
    const size = ref.shape.reduce((a, b) => a * b, 1);
    this.q = all.subarray(ref.at, ref.at + size);
    this._max = null;
  }
  units(k) { const q = this.q[k]; return q === NOT_FINITE ? NaN : this.ref.lo + q; }
  value(k) { const u = this.units(k); return u * Math.pow(10, this.ref.exp); }
  text(k) { return fixed(this.units(k), this.ref.exp); }
  max() {
    if (this._max === null) {
      let m = -Infinity;
      for (let k = 0; k < this.q.length; k++) if (this.q[k] !== NOT_FINITE) m = Math.max(m, this.units(k));
      this._max = m === -Infinity ? 0 : m * Math.pow(10, this.ref.exp);
    }
    return this._max;
  }
}

async function arr(ref) { return ref ? new Arr(ref, await group(ref.group)) : null; }

function fixed(units, exp) {  // integer units of 10^exp as a decimal, exactly
  if (Number.isNaN(units)) return "not finite";
  if (exp >= 0) return String(units * Math.pow(10, exp));
  const d = -exp, s = String(Math.abs(units)).padStart(d + 1, "0");
  return (units < 0 ? "-" : "") + s.slice(0, s.length - d) + "." + s.slice(s.length - d);
}

// The pattern of a head as the page draws it: exact, or pooled with the exact rows that were kept.
async function pattern(li, hi) {
  const h = META.layers[li].heads[hi];
  const exact = await arr(h.attention);
  const grid = exact || await arr(h.attention_pooled);
  const masks = exact ? await arr(h.masked) : null;  // 1 where the mask forbids the key (views/explorer.py)
  const rows = new Map();
  for (const [q, ref] of h.rows) rows.set(q, await arr(ref));
  const pool = exact ? [1, 1] : h.pool;
  return { head: h, grid, exact, rows, pool, n_Q: META.queries.length, n_K: META.keys.length, masks,
           masked(i, j) { return !!masks && masks.value(i * masks.shape[1] + j) > 0.5; },
           row(q) { return exact ? { arr: exact, base: q * exact.shape[1] } : rows.has(q) ? { arr: rows.get(q), base: 0 } : null; } };
}
