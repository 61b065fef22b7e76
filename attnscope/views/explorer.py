"""The explorer page: what one self-contained HTML page shows of a run, and the page itself.

A run becomes a `Page` (views/sources.py builds one from each command's result): its header, its tables (the
steps: name, dims = shape, op, dtype, size, FLOPs; a model head's weights; the check; a trace's line-up) and
its attention as `Layer`s of `Head`s (pattern, kind, statistics). What later commands add only fills fields
that are here already, and the page draws each when present:

- every layer (`--all-layers`): more `Layer`s, each with its real `layer` number (labels say "layer 2", never
  a position in the list), and the grid of every head's kind as a letter (KIND_LETTERS, the terminal's);
- generation (`--generate`): `Page.decode`, one `DecodeStep` per new token, as --json's `decode_steps`
  (`token_id, token, position, attention [n_head, n_K], kv_cache_bytes`), `Page.decode_layer` the layer whose
  rows they are; a step's `evicted` key ranges are drawn as evicted;
- long inputs: a `Head` holds `attention_pooled` with `pool = (rows per cell, columns per cell)` (each cell the
  mean over its queries of their total weight on its keys, so a pooled row still sums to 1) and the exact
  `rows` of the queries asked, in place of its exact `attention`.

A head's `masked` marks the keys its mask forbids (True: -inf in `masked_scores`), drawn hatched, apart from a
weight that is merely near 0. A page whose title ends with a layer and head (`subject` + "layer 2, head 3")
retitles itself with the ones shown, and a table about one layer or head (`Table.layer`, `Table.head`) says so
when another is shown.

`page_html(page)` writes it: one HTML file with its styles, script and data inline and a Content Security
Policy that forbids every request, so it works from `file://` and as an attachment. The tables are plain
HTML (readable where scripts do not run); the heatmaps, selectors and panels are drawn by the script
(views/assets/*.js) from the data, packed compactly by views/packing.py. A page whose patterns would pass
MAX_CELLS weights is pooled to fit first (`fit`), and says so.
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from attnscope.cost import format_bytes
from attnscope.views.colors import VIRIDIS

if TYPE_CHECKING:
    from torch import Tensor

    from attnscope.views.packing import Packer

MAX_CELLS = 24_000_000  # weights a page holds exactly: MiniLM's 6 layers x 12 heads at 512 tokens is 18.9M
POOLED_SIDE = 512  # beyond MAX_CELLS, each pattern is pooled to at most this many cells a side
DATA_BUDGET = 14_000_000  # characters of packed data, before a decimal is given up (views/packing.py)
# the page's script, joined in one function scope
SCRIPTS = ("data.js", "draw.js", "decode.js", "overlay.js", "readings.js", "explorer.js")
# A head's kind (readings/headstats.py's KINDS) as one letter: the --all-layers grid, in the terminal and on the page
KIND_LETTERS = {"first-token": "F", "previous-token": "P", "self": "S", "induction": "I", "broad": "B", "local": "L",
                "mixed": "·"}


@dataclass
class Table:
    """A table as the page shows it: cells as text; `numeric` columns are right-aligned; `marks` gives a row
    a class (`bad` for a divergence or a failed check, `good`)."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    numeric: tuple[int, ...] = ()
    code: tuple[int, ...] = ()  # columns of code (an op, a checkpoint key), set in the code colour
    testid: str = ""
    marks: list[str] = field(default_factory=list)
    layer: int | None = None  # the entry of Page.layers (and of its heads) the table is about, where it is one
    head: int | None = None


@dataclass
class Head:
    """One head's pattern `[n_Q, n_K]` (rows = queries), or for a long input its pooled pattern and the exact
    rows kept; its kind and statistics (attnscope/headstats.py) where known. `head` is None for an attention
    without heads."""

    head: int | None
    attention: Tensor | None = None
    kind: str | None = None
    stats: dict[str, float] | None = None
    attention_pooled: Tensor | None = None
    pool: tuple[int, int] = (1, 1)
    rows: dict[int, Tensor] = field(default_factory=dict)  # query index -> its exact row [n_K]
    masked: Tensor | None = None  # bool [n_Q, n_K]: True where the mask forbids the key (exact patterns only)
    kind_also: str | None = None  # a second kind the head also fits (readings/headstats.kind_also)

    @property
    def label(self) -> str:
        return "attention" if self.head is None else f"head {self.head}"


@dataclass
class Layer:
    """Every head of one layer; `layer` is the model's layer number (None for a run without layers: then the
    label names what the entry is, a batch element)."""

    layer: int | None
    heads: list[Head]
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            self.label = "attention" if self.layer is None else f"layer {self.layer}"


@dataclass
class DecodeStep:
    """One generated token: its id and text, its position, its layer's attention row for every head
    `[n_head, n_K]` (n_K grows by one a step), and the KV cache's bytes after it."""

    token_id: int
    token: str
    position: int
    attention: Tensor
    kv_cache_bytes: int
    evicted: list[tuple[int, int]] = field(default_factory=list)  # key ranges [start, stop) out of the cache


@dataclass
class Page:
    title: str
    header: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)  # the query tokens' labels, in order
    keys: list[str] = field(default_factory=list)
    layers: list[Layer] = field(default_factory=list)
    focus: tuple[int, int] = (0, 0)  # the layer and head (indexes into `layers` and its heads) opened first
    offset: int = 0  # query i sits at position i + offset (a KV cache's new queries come after the cache)
    axis: str = "layer"  # what the layer selector picks: "layer", or "batch element" for a run without layers
    decode: list[DecodeStep] | None = None
    decode_layer: int | None = None
    notes: list[str] = field(default_factory=list)
    footer: list[str] = field(default_factory=list)
    verdict: tuple[str, str] | None = None  # ("good" or "bad", a line): a trace's outcome, a failed check
    pattern_note: str = ""  # where the pattern comes from, under the heatmap
    sparse: bool = False  # a sparse indexer's layer: a hidden key the causal mask allows was not selected
    subject: str = ""  # where the title ends with the layer and head, its start: the heading follows those shown
    image: dict[str, Any] | None = None  # head --image: the image (a data: URI) and its patch grid (overlay.js)
    sinks: dict[str, Any] | None = None  # the sinks view: readings/sinkshare.py's layer x head grid (readings.js)
    rollout: dict[str, Tensor] = field(default_factory=dict)  # "rollout", "rollout_weighted": [n_Q, n_K] each


def page_html(page: Page) -> str:
    """The page: one self-contained HTML document (no request of any kind), ready to write to a file."""
    from attnscope.views.packing import DECIMALS, Packer

    fit(page)
    for decimals in DECIMALS:  # the finest that fits, judged first from the largest group alone
        packer = Packer(exp=-decimals)
        meta = _meta(page, packer, decimals)
        if decimals != DECIMALS[-1] and packer.estimate() > DATA_BUDGET:
            continue
        blobs = packer.blobs()
        if sum(map(len, blobs.values())) <= DATA_BUDGET:
            break
    meta["decimals_note"] = "" if decimals == DECIMALS[0] else (
        f"weights shown to {decimals} decimals, to keep this page under {DATA_BUDGET // 1_000_000} MB of data")
    data = "\n".join(f'<script type="application/octet-stream" id="attnscope-{name}">{text}</script>'
                     for name, text in blobs.items())
    parts = {"TITLE": html.escape(page.title), "STYLE": _asset("explorer.css"),
             "SCRIPT": "\n".join(map(_asset, SCRIPTS)), "STATIC": static_html(page), "META": _script_json(meta),
             "DATA": data}
    return re.sub(r"@(TITLE|STYLE|SCRIPT|STATIC|META|DATA)@", lambda m: parts[m.group(1)], _asset("explorer.html"))


def fit(page: Page) -> None:
    """Pool every exact pattern (keys summed, queries averaged: attnscope/pooling.py) when the page's patterns
    hold more than MAX_CELLS weights, so that any run still makes a page that opens."""
    exact = [(h, h.attention) for layer in page.layers for h in layer.heads if h.attention is not None]
    cells = sum(int(A.numel()) for _, A in exact)
    if cells <= MAX_CELLS:
        return
    from attnscope.views.pooling import group_size, pool

    for h, A in exact:
        n_Q, n_K = A.shape
        h.pool = (group_size(n_Q, POOLED_SIDE), group_size(n_K, POOLED_SIDE))
        h.attention_pooled, h.attention = pool(A, *h.pool), None
    page.notes.append(f"the patterns hold {cells:,} weights, more than the {MAX_CELLS:,} a page holds exactly: each "
                      f"is pooled to at most {POOLED_SIDE} x {POOLED_SIDE} cells (keys summed, queries averaged)")


def _meta(page: Page, packer: Packer, decimals: int) -> dict[str, Any]:
    layers, masks = [], _Masks(packer)
    for i, layer in enumerate(page.layers):
        group = f"layer-{i}"
        heads = []
        for h in layer.heads:
            entry: dict[str, Any] = {"head": h.head, "label": h.label, "kind": h.kind, "kind_also": h.kind_also,
                                     "stats": _clean(h.stats) if h.stats else None, "pool": list(h.pool),
                                     "attention": packer.add(group, h.attention) if h.attention is not None else None,
                                     "attention_pooled": (packer.add(group, h.attention_pooled)
                                                          if h.attention_pooled is not None else None),
                                     "rows": [[q, packer.add(group, row)] for q, row in sorted(h.rows.items())],
                                     "masked": masks.add(h.masked) if h.attention is not None else None}
            heads.append(entry)
        layers.append({"layer": layer.layer, "label": layer.label, "heads": heads})
    decode = None
    if page.decode is not None:
        decode = {"layer": page.decode_layer,
                  "steps": [{"token_id": s.token_id, "token": s.token, "position": s.position,
                             "kv_cache_bytes": s.kv_cache_bytes, "kv_cache": format_bytes(s.kv_cache_bytes),
                             "evicted": [list(r) for r in s.evicted],
                             "attention": packer.add("decode", s.attention)} for s in page.decode]}
    return {"version": 1, "title": page.title, "queries": page.queries, "keys": page.keys, "offset": page.offset,
            "axis": page.axis, "layers": layers, "focus": list(page.focus), "decode": decode,
            "decimals": decimals, "pattern_note": page.pattern_note, "sparse": page.sparse,
            "viridis": [list(c) for c in VIRIDIS],
            "subject": page.subject, "kind_letters": KIND_LETTERS, "image": page.image, "sinks": page.sinks,
            "rollout": {name: packer.add("readings", matrix) for name, matrix in page.rollout.items()}}


class _Masks:
    """Each distinct mask packed once (group `masks`, 1 where masked): a layer's heads share theirs."""

    def __init__(self, packer: Packer) -> None:
        self.packer = packer
        self.seen: dict[tuple[tuple[int, ...], bytes], dict[str, Any]] = {}

    def add(self, masked: Tensor | None) -> dict[str, Any] | None:
        if masked is None or not bool(masked.any()):
            return None
        import numpy as np

        bits = masked.detach().cpu().numpy().astype(bool)
        key = (bits.shape, np.packbits(bits).tobytes())
        if key not in self.seen:
            self.seen[key] = self.packer.add("masks", bits.astype(np.float64))
        return self.seen[key]


def static_html(page: Page) -> str:
    """The parts of the page that need no script: header, verdict, tables, notes, footer."""
    parts = [f"<h1 id='page-title' data-testid='page-title'>{html.escape(page.title)}</h1>"]
    if page.header:
        parts.append("<div class='header'>" + "".join(f"<div>{html.escape(line)}</div>" for line in page.header)
                     + "</div>")
    if page.verdict:
        parts.append(f"<p class='verdict {page.verdict[0]}'>{html.escape(page.verdict[1])}</p>")
    parts += [table_html(t) for t in page.tables]
    if page.footer:
        parts.append("<div class='footer'>" + "".join(f"<div>{html.escape(line)}</div>" for line in page.footer)
                     + "</div>")
    if page.notes:
        parts.append("<ul class='notes'>" + "".join(f"<li>note: {html.escape(n)}</li>" for n in page.notes)
                     + "</ul>")
    return "\n".join(parts)


def table_html(table: Table) -> str:
    """A table with its text cells left-aligned and its numbers right-aligned, said on every cell (a notebook's
    stylesheet right-aligns cells otherwise)."""
    testid = f" data-testid='{html.escape(table.testid)}'" if table.testid else ""
    about = "".join(f" data-{name}='{value}'" for name, value in (("layer", table.layer), ("head", table.head))
                    if value is not None)

    def align(i: int) -> str:
        return "num" if i in table.numeric else "text code" if i in table.code else "text"

    head = "".join(f"<th class='{align(i)}' scope='col'>{html.escape(c)}</th>" for i, c in enumerate(table.columns))
    body = []
    for r, row in enumerate(table.rows):
        mark = table.marks[r] if r < len(table.marks) else ""
        cells = "".join(f"<td class='{align(i)}'>{html.escape(v)}</td>" for i, v in enumerate(row))
        body.append(f"<tr class='{mark}'>{cells}</tr>" if mark else f"<tr>{cells}</tr>")
    return (f"<table class='steps'{testid}{about}><caption>{html.escape(table.title)}</caption><thead><tr>{head}</tr>"
            f"</thead><tbody>{''.join(body)}</tbody></table>")


def _script_json(value: Any) -> str:
    """JSON that can sit inside a <script> element: no `</script>`, no `<!--`, whatever the tokens hold."""
    text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _clean(stats: dict[str, float]) -> dict[str, float | None]:
    return {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in stats.items()}


def _asset(name: str) -> str:
    return resources.files("attnscope.views").joinpath("assets").joinpath(name).read_text(encoding="utf-8")
