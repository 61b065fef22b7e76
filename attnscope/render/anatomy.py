"""`attnscope anatomy`: one row per kind of layer (identical layers folded, their indices as ranges), the totals,
one line for each thing the table cannot say by itself; and the JSON (docs/json.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console

from attnscope.cost import format_bytes, format_flops
from attnscope.render.console import path_lines
from attnscope.render.fit import Column, FittedTable, FittedText, cell, whole
from attnscope.render.tables import short_flops

if TYPE_CHECKING:
    from attnscope.anatomy.kinds import Rope
    from attnscope.anatomy.read import Anatomy, Layer

POSITION_WORDS = {"nope": "NoPE", "absolute": "absolute", "relative": "rel. bias", "alibi": "ALiBi",
                  "not rope": "no RoPE", "none": "-"}
QK_NORM_WORDS = {"RMSNorm per head": "RMSNorm over each head's q and k, before RoPE",
                 "RMSNorm over the projection": "RMSNorm over the whole q and k projections, before the split "
                                                "into heads",
                 "L2 per head": "L2 norm of each head's q and k (no weight), on the RoPE layers only",
                 "LayerNorm per head": "LayerNorm over each head's q and k",
                 "per config": "the config turns it on; how this family norms is not known to anatomy"}


def rope_text(layer: Layer) -> str:
    """`default 1M`, `yarn x32 150k`, `default 10k 25%`; or the layer's other kind of positions."""
    r = layer.rope
    if r is None:
        return POSITION_WORDS.get(layer.position, layer.position)
    factor = f" x{r.factor:g}" if r.factor is not None and r.type != "default" else ""
    fraction = f" {r.fraction * 100:g}%" if r.fraction < 1 else ""
    return f"{r.type}{factor} {short_base(r.base)}{fraction}"


def short_base(base: float) -> str:
    """10000 -> 10k, 1000000 -> 1M, 500000 -> 500k; other numbers as they are."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if base >= size and base / size == round(base / size, 2):
            return f"{base / size:g}{suffix}"
    return f"{base:g}"


def show_anatomy(out: Console, anatomy: Anatomy) -> None:
    from attnscope.anatomy.read import groups, ranges

    out.print(FittedText(_header(anatomy, out.width), style="bold"))
    columns = [Column("layers", style="bold cyan"), Column("n", justify="right"), Column("kind"),
               Column("heads q/kv", justify="right"), Column("d_head", justify="right"), Column("RoPE"),
               Column("KV/layer", justify="right", drop=2), Column("FLOPs/tok", justify="right", drop=1)]
    rows = []
    for layer, indices in groups(anatomy):
        sizes = anatomy.sizes(layer)
        where = ranges(indices) if layer.stack == "decoder" else f"{layer.stack} {ranges(indices)}"
        d_head = str(layer.d_K) if layer.d_K == layer.d_V else f"{layer.d_K}/{layer.d_V}"
        cache = "-" if sizes is None or sizes.kv_cache_bytes is None else format_bytes(sizes.kv_cache_bytes)
        flops = "-" if sizes is None or sizes.flops_per_token is None else short_flops(sizes.flops_per_token)
        rows.append([cell(_parts(where)), cell(whole(str(len(indices)))), cell(_parts(layer.label)),
                     cell(whole(f"{layer.n_head}/{layer.n_kv_head}" if layer.n_head else "-")),
                     cell(whole(d_head if layer.n_head else "-")),
                     cell(_parts(rope_text(layer), " ")), cell(whole(cache)), cell(whole(flops))])
    out.print(FittedTable(columns, rows, shrink=[2, 6, 0]))
    totals = anatomy.totals()
    if totals["kv_cache_bytes"] is not None:
        full = totals["kv_cache_bytes_full_heads"]
        out.print(FittedText(f"total KV cache {format_bytes(totals['kv_cache_bytes'])}"
                             + (f" (as full heads {format_bytes(full)})" if full is not None else "")
                             + f" at {anatomy.tokens} tokens; attention {format_flops(totals['flops_per_token'] or 0)}"
                             f" for token {anatomy.tokens}", style="bold"))
    for line in notes(anatomy):
        out.print(FittedText(line))


def _parts(text: str, between: str = ", ") -> tuple[list[str], None]:
    """A paragraph that breaks only between its parts (`sliding 512,` | `qk-norm`), never inside one."""
    parts = text.split(between)
    ends = [part + between.rstrip() for part in parts[:-1]] + parts[-1:]
    return [ends[0], *(" " + part for part in ends[1:])], None


def _header(anatomy: Anatomy, width: int = 10**6) -> str:
    named = f"{anatomy.model_type} ({anatomy.architecture})" if anatomy.architecture else anatomy.model_type
    model = anatomy.model
    if len(model) + 1 > width:  # a long path breaks after a `/`, never inside a name (render/console.path_lines)
        model = "\n".join(path_lines(model + ":", width))[:-1]
    part = ", text part (text_config)" if anatomy.part else ""
    stacks = [layer.stack for _, layer in anatomy.layers]
    count = (f"{stacks.count('encoder')} encoder and {stacks.count('decoder')} decoder layers"
             if "cross" in stacks else f"{len(stacks)} layers")
    at = f"at {anatomy.tokens} tokens ({anatomy.tokens_from}), " if anatomy.tokens is not None else ""
    if " " not in anatomy.dtype_from:  # a key (`torch_dtype`, `--dtype`): beside the dtype
        return f"{model}: {named}{part}, {count}\n{at}{anatomy.dtype} ({anatomy.dtype_from}), one sequence"
    # a sentence (no dtype named, a GGUF's): a line of its own, never split over two by the wrapping
    return f"{model}: {named}{part}, {count}\n{at}{anatomy.dtype}, one sequence\n" \
           f"{anatomy.dtype}: {anatomy.dtype_from}"


def notes(anatomy: Anatomy) -> list[str]:
    """One line for each thing the table cannot say by itself."""
    from attnscope.anatomy.read import groups

    out = list(anatomy.assumed)
    layers = [layer for layer, _ in groups(anatomy)]
    if anatomy.tokens is None:
        out.append("the config names no context length: give --tokens N for the KV cache and FLOPs")
    for layer in layers:
        out += [line for line in _layer_notes(anatomy, layer) if line not in out]
    for described in sorted({layer.qk_norm for layer in layers if layer.qk_norm}):
        out.append(f"qk-norm: {QK_NORM_WORDS.get(described, described)}")
    if anatomy.tokens is not None:
        out.append("FLOPs/tok: the N-th token's scores, scale, softmax and weighted sum (projections not "
                   "counted; conventions in docs/performance.md)")
    if anatomy.uninterpreted:
        out.append(f"not interpreted: {', '.join(anatomy.uninterpreted)}")
    return out


def _layer_notes(anatomy: Anatomy, layer: Layer) -> list[str]:
    out = []
    if layer.mla is not None:
        m = layer.mla
        out.append(f"MLA: the cache holds the latent, kv_lora_rank {m.kv_lora_rank} + qk_rope_head_dim "
                   f"{m.qk_rope_head_dim} = {m.kv_lora_rank + m.qk_rope_head_dim} numbers a token, as transformers "
                   f"stores it (5.23 caches kv_nope and k_rot); as full heads, what transformers 4.x cached, "
                   f"{layer.n_head} x ({layer.d_K} + {layer.d_V}) = {layer.n_head * (layer.d_K + layer.d_V)}")
    if layer.attention == "sliding":
        out += _sliding_notes(layer)
    if layer.attention == "chunked" and layer.chunk:
        out.append(f"chunked {layer.chunk}: a query sees the keys of its own chunk of {layer.chunk} positions, "
                   f"causally; transformers caches it as a sliding window, keeping the last {layer.chunk - 1}")
    if layer.stack == "encoder":
        out.append("encoder layers keep no KV cache; their FLOPs are for a token in the middle of N")
    if layer.stack == "cross" and anatomy.source_tokens is not None:
        out.append(f"cross: each decoder layer caches the encoder's keys and values for {anatomy.source_tokens} "
                   "source tokens")
    if layer.sinks:
        out.append("sinks: a learned logit per head joins each softmax row and is dropped after (rows sum to < 1)")
    if layer.position == "nope":
        out.append("NoPE: these layers rotate nothing; position comes from the causal mask alone")
    return out + _notes_2026(anatomy, layer)


def _sliding_notes(layer: Layer) -> list[str]:
    """What a sliding layer's window is: a query's last W keys (and what its cache keeps), or W on both sides."""
    window = layer.window or 0  # a sliding layer always has its window (anatomy/kinds.py)
    last = f"sliding {window}: a query sees the last {window} keys, itself included"
    if layer.keeps_all:
        return [f"{last} (sliding_window masks MiniMax's softmax layers); MiniMaxCache keeps every token"]
    if layer.causal:
        return [f"{last}; the cache keeps the last {window - 1} (W - 1, as transformers' DynamicSlidingWindowLayer)"]
    if window:
        return [f"sliding {window}, bidirectional: a token sees the {window // 2} tokens on each side of it "
                "(transformers' sliding_window_bidirectional_overlay)"]
    return []


def _notes_2026(anatomy: Anatomy, layer: Layer) -> list[str]:
    """The cache of 2026's layers in words: indexer keys, a linear layer's state, a shared cache, compression."""
    out = []
    index, state, c = layer.indexer, layer.state, layer.compress
    if index is not None and index.own:
        out.append(f"indexed top-{index.topk}: a lightning indexer ({index.n_heads} heads of {index.head_dim}) scores "
                   f"every key and each query attends to its best {index.topk}; the cache adds its keys, "
                   f"index_head_dim {index.head_dim} numbers a token (DynamicIndexedLayer's indexer_keys)")
    elif index is not None:
        out.append(f"indexed top-{index.topk} (previous layer's): indexer_types 'shared' reuses the previous full "
                   "layer's choice of keys and caches no indexer keys")
    if state is not None:
        held = format_bytes(state.bytes(anatomy.bytes_per_number))
        if state.kernel:
            out.append(f"linear ({state.kind}): no keys are kept; a state of {state.heads} x [{state.d_k}, "
                       f"{state.d_v}] float32 and a conv window of {state.kernel} x {state.conv_dim} ({held}), the "
                       "same at any number of tokens (LinearAttentionLayer)")
        else:  # MiniMax: no convolution, the state in the model's dtype
            out.append(f"linear ({state.kind}): no keys are kept; a state of {state.heads} x [{state.d_k}, "
                       f"{state.d_v}] {'float32' if state.float32 else anatomy.dtype} ({held}), the same at any "
                       "number of tokens (MiniMaxCache's linear_cache)")
    if layer.kv_from is not None:
        from attnscope.anatomy.read import ranges

        readers = ranges([i for i, other in anatomy.layers if other.kv_from == layer.kv_from])
        out.append(f"KV of layer {layer.kv_from}: layers {readers} compute no keys or values and cache nothing "
                   f"(num_kv_shared_layers; transformers' DummyLayer): they read layer {layer.kv_from}'s, counted "
                   "once, there")
    if layer.k_eq_v:
        out.append("K = V (attention_k_eq_v): the values are the keys' projection, normed apart; the cache still holds "
                   "both")
    if c is not None:
        top = (f"; an indexer ({c.indexer.n_heads} heads of {c.indexer.head_dim}) picks the best {c.indexer.topk} "
               "entries for each query, and caches its own compressed keys") if c.indexer else ""
        out.append(f"compressed 1/{c.rate}: one entry of d_head per {c.rate} tokens beside a sliding window of "
                   f"{layer.window} keys that are also the values, plus the tokens since the last whole window"
                   f"{' (overlapping windows: two series a token)' if c.overlap else ''}{top}"
                   + (f"; the entries rotate with base {c.rope_base:g}" if c.rope_base else "")
                   + f" (DeepseekV4{'CSA' if c.overlap else 'HCA'}Cache)")
    return out


def rope_json(rope: Rope | None) -> dict[str, Any] | None:
    if rope is None:
        return None
    return {"type": rope.type, "base": rope.base, "fraction": rope.fraction, "rotated": rope.rotated,
            "factor": rope.factor, "original_context": rope.original_context}


def layer_json(anatomy: Anatomy, index: int, layer: Layer) -> dict[str, Any]:
    sizes = anatomy.sizes(layer)
    m = layer.mla
    return {"index": index, "stack": layer.stack, "kind": layer.attention, "label": layer.label,
            "causal": layer.causal, "n_head": layer.n_head, "n_kv_head": layer.n_kv_head, "head_dim": layer.d_K,
            "d_K": layer.d_K, "d_V": layer.d_V, "window": layer.window, "chunk": layer.chunk,
            "position": layer.position, "rope": rope_json(layer.rope), "qk_norm": layer.qk_norm,
            "sinks": layer.sinks, "softcap": layer.softcap,
            "mla": None if m is None else {"q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
                                           "qk_nope_head_dim": m.qk_nope_head_dim,
                                           "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim},
            "cached_tokens": sizes.cached_tokens if sizes else None,
            "kv_cache_bytes": sizes.kv_cache_bytes if sizes else None,
            "kv_cache_bytes_full_heads": sizes.full_heads_bytes if sizes else None,
            "keys": sizes.keys if sizes else None, "flops_per_token": sizes.flops_per_token if sizes else None,
            "indexer": _fields(layer.indexer), "state": _fields(layer.state), "kv_shared_from": layer.kv_from,
            "k_eq_v": layer.k_eq_v, "compress": None if layer.compress is None else {
                "rate": layer.compress.rate, "overlap": layer.compress.overlap,
                "indexer": _fields(layer.compress.indexer)},
            "indexer_bytes": sizes.indexer_bytes if sizes else None,
            "state_bytes": sizes.state_bytes if sizes else None}


def _fields(value: Any) -> dict[str, Any] | None:
    """A frozen dataclass of numbers and words as a JSON object."""
    from dataclasses import asdict

    return None if value is None else asdict(value)


def anatomy_json(anatomy: Anatomy) -> dict[str, Any]:
    from attnscope.anatomy.read import groups, ranges

    grouped = []
    for layer, indices in groups(anatomy):
        sizes = anatomy.sizes(layer)
        per_layer = sizes.kv_cache_bytes if sizes else None
        grouped.append({"stack": layer.stack, "layers": ranges(indices), "indices": indices, "count": len(indices),
                        "kind": layer.attention, "label": layer.label, "kv_cache_bytes": per_layer,
                        "kv_cache_bytes_total": None if per_layer is None else per_layer * len(indices)})
    return {"command": "anatomy", "model": anatomy.model, "config": str(anatomy.config_path),
            "model_type": anatomy.model_type, "architecture": anatomy.architecture, "part": anatomy.part,
            "tokens": anatomy.tokens, "tokens_from": anatomy.tokens_from, "source_tokens": anatomy.source_tokens,
            "dtype": anatomy.dtype, "dtype_from": anatomy.dtype_from, "bytes_per_number": anatomy.bytes_per_number,
            "batch": 1, "layers": [layer_json(anatomy, index, layer) for index, layer in anatomy.layers],
            "groups": grouped, "totals": anatomy.totals(), "uninterpreted": anatomy.uninterpreted,
            "notes": notes(anatomy)}
