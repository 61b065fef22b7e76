"""A decode step's cache in the layout the code keeps it in, read from the op it raised on.

trace hands a cache as transformers' caches hold it, `[n_batch, n_kv_head, n_cache, d_head]`. Code keeps it in
other layouts too: sequence-major `[n_batch, n_cache, n_kv_head, d_head]` (mistral-inference, Meta's llama before
the transpose, joined on dim 1), heads folded into the batch `[n_batch·n_kv_head, n_cache, d_head]` (fairseq's
incremental state), time-first `[n_cache, n_batch, n_kv_head, d_head]` (Megatron's inference cache), the keys
transposed `[.., d_head, n_cache]` beside the values (BLOOM's), each of those stacked in one tensor `[2, ..]`
(GPT-2's `present`) or joined on their last axis `[.., 2·d_head]` (GPTBigCode's `layer_past`, split `(d_head,
d_head)` on dim -1), or transformers' Cache object (hfcache.py: `past_key_value.update(k, v, layer_idx)`). Code that
raises on the first is handed the others, those whose shape meets the op it raised on (every axis but one the same
as another tensor's there: the one it joins on) first; the first it runs on is its layout, a convention of the
code, noted. The reference keeps its own layout: only what the code is handed changes.

Code that runs on trace's layout may still keep another, where two of its sizes are equal (`--cache 2` beside 2
key/value heads: `[n_batch, 2, 2, d_head]` is either): the axis the code's own `torch.cat` joins the cache on is
the positions' axis, so a join on another axis than trace's layout holds them on says the layout (`read`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.record import Failure, Record

# layout -> its dims, for the trace's input rows; "bhnd" is trace's own (transformers')
BASES = {"bhnd": ("n_batch", "n_kv_head", "n_cache", "d_head"),
         "bnhd": ("n_batch", "n_cache", "n_kv_head", "d_head"),
         "nbhd": ("n_cache", "n_batch", "n_kv_head", "d_head"),
         "(bh)nd": ("n_batch·n_kv_head", "n_cache", "d_head")}
BASE_WORDS = {"bhnd": "transformers'", "bnhd": "sequence-major, mistral-inference's and Meta's llama's",
              "nbhd": "time-first, Megatron's", "(bh)nd": "heads folded into the batch, fairseq's"}
# the keys held transposed, [.., d_head, n_cache], the values as the base layout holds them (BLOOM's before
# transformers' Cache: keys [n_batch·n_head, d_head, n], values [n_batch·n_head, n, d_head], joined on 2 and on 1)
TRANSPOSED = {"bhdn": "bhnd", "(bh)dn": "(bh)nd"}
STACKED = "2·"  # keys and values stacked on a first axis, one tensor [2, ..] (GPT-2's and GPT-NeoX's `present`)
# keys and values joined on their last axis, one tensor [.., 2·d_head] split (d_head, d_head) (GPTBigCode's
# `layer_past`, multi-query [n_batch, n_cache, 2·d_head]: heads folded into the batch, one key/value head)
FUSED = "kv·"
OBJECT = "Cache"  # transformers' Cache object (hfcache.py): update(k, v, layer_idx) joins, [B, H_kv, N, D]
# a cache with room for the new positions, written in place at them and read whole (gemma_pytorch's kv_cache
# [n_batch, max_len, n_kv_head, d_head], `k_cache.index_copy_(1, kv_write_indices, xk)`; gpt-fast's KVCache): each
# base layout as long as the cached and the new positions together, n_K, the new ones zero
ROOM = "room·"
# the pair in a dict the code reads by keys of its own (keyedcache.py: HF XLM's {"slen": n, layer_id: (k, v)})
KEYED = "dict·"
# layout -> its keys' dims (its values': dims_of)
DIMS = BASES | {key: (*BASES[base][:-2], "d_head", "n_cache") for key, base in TRANSPOSED.items()} \
    | {STACKED + base: ("2", *dims) for base, dims in BASES.items()} | {OBJECT: BASES["bhnd"]} \
    | {FUSED + base: (*dims[:-1], "2·d_head") for base, dims in BASES.items()} \
    | {ROOM + base: tuple("n_K" if d == "n_cache" else d for d in dims) for base, dims in BASES.items()} \
    | {KEYED + base: dims for base, dims in BASES.items()}
# the layouts handed as a pair, which code that takes its keys and values as two parameters may keep
PAIRED = (*BASES, *TRANSPOSED, *(ROOM + base for base in BASES))


def dims_of(layout: str, keys: bool) -> tuple[str, ...]:
    """The dims of the keys (`keys`) or the values as `layout` holds them, for the trace's input rows."""
    if layout.startswith(FUSED):
        return BASES[layout.removeprefix(FUSED)]
    return DIMS[layout] if keys or layout not in TRANSPOSED else BASES[TRANSPOSED[layout]]


def words(layout: str) -> str:
    """`[n_batch, n_cache, n_kv_head, d_head] (sequence-major, ...)`: a layout in words."""
    if layout == OBJECT:
        return (f"transformers' Cache object, {words('bhnd').split(' (')[0]} for every layer (DynamicCache: "
                "update(key_states, value_states, layer_idx) hands back the keys and values joined)")
    if layout in TRANSPOSED:
        return (f"keys [{', '.join(DIMS[layout])}] (transposed), values [{', '.join(dims_of(layout, False))}] "
                "(BLOOM's)")
    if layout.startswith(FUSED):
        return (f"[{', '.join(DIMS[layout])}] (keys and values joined on the last axis, GPTBigCode's layer_past: "
                "[n_batch, n_cache, 2·d_head] where one key/value head serves every query head)")
    if layout.startswith(ROOM):
        return (f"[{', '.join(DIMS[layout])}], room for the cached and the new positions together (n_K = n_cache + "
                "n_Q), written in place at the new positions and read whole")
    if layout.startswith(KEYED):
        return f"{words(layout.removeprefix(KEYED))} in a dict your code reads by keys of its own"
    base = layout.removeprefix(STACKED)
    said = BASE_WORDS[base] if base == layout else f"keys and values stacked in one tensor, {BASE_WORDS[base]}"
    return f"[{', '.join(DIMS[layout])}] ({said})"


def held(tensor: torch.Tensor, layout: str, keys: bool = True, n_new: int = 0) -> torch.Tensor:
    """A cache tensor `[n_batch, n_kv_head, n_cache, d_head]` laid out as `layout`'s keys (`keys`) or values
    (contiguous, as a cache the code filled would be); a ROOM layout's with `n_new` zero positions after the cached
    ones, for the code to write the new keys and values into."""
    if layout.startswith(ROOM):
        import torch

        base = layout.removeprefix(ROOM)
        laid = held(tensor, base)
        room = list(laid.shape)
        axis = BASES[base].index("n_cache")
        room[axis] = n_new
        return torch.cat([laid, laid.new_zeros(room)], dim=axis)
    if layout in TRANSPOSED:
        values = held(tensor, TRANSPOSED[layout])
        return values.transpose(-1, -2).contiguous() if keys else values
    base = layout.removeprefix(STACKED).removeprefix(FUSED).removeprefix(KEYED)
    if base == "bnhd":
        return tensor.transpose(1, 2).contiguous()
    if base == "nbhd":
        return tensor.permute(2, 0, 1, 3).contiguous()
    if base == "(bh)nd":
        return tensor.reshape(tensor.shape[0] * tensor.shape[1], *tensor.shape[2:]).contiguous()
    return tensor


def handed(parts: tuple[torch.Tensor, ...], layout: str, layer_slots: dict[int, str] | None = None) -> Any:
    """What the code's cache parameter gets, from `(K_cache, V_cache)` laid out as `layout` (`held`): the pair (which
    answers a dict's keys too: cacheforms.Handed), one tensor stacking them or joining them on the last axis,
    transformers' Cache object holding them, or a dict answering the keys the code reads (keyedcache.py: its layer's
    pair under the module's own index, `layer_slots`, and the cached length)."""
    import torch

    from attnscope.usertrace.cacheforms import Handed

    if layout.startswith(KEYED):
        from attnscope.usertrace.keyedcache import Keyed

        n_cache = int(parts[0].shape[BASES[layout.removeprefix(KEYED)].index("n_cache")])
        return Keyed((parts[0], parts[1]), n_cache, layer_slots or {})
    if layout == OBJECT:
        from attnscope.usertrace.hfcache import HandedCache

        return HandedCache(*parts)
    if layout.startswith(FUSED):
        return torch.cat(parts, dim=-1)
    return torch.stack(parts) if layout.startswith(STACKED) else Handed(*parts)


def _shape(cache: tuple[torch.Tensor, torch.Tensor], layout: str, n_new: int = 0) -> tuple[int, ...]:
    part = tuple(held(cache[0], layout, n_new=n_new).shape)
    if layout.startswith(FUSED):
        return (*part[:-1], 2 * part[-1])
    return (2, *part) if layout.startswith(STACKED) else part


def others(failure: Failure | None, cache: tuple[torch.Tensor, torch.Tensor], apart: bool = False,
           n_new: int = 0) -> list[str]:
    """The layouts to try after the code raised on trace's own: those whose shape meets the op it raised on first,
    the ones with room for the `n_new` new positions last (none where there are none); `apart`: the keys and values
    go to two parameters, so only the layouts handed as a pair."""
    tried = [layout for layout in (PAIRED if apart else DIMS) if layout != "bhnd"
             and (n_new or not layout.startswith(ROOM))]
    if cache[0].shape != cache[1].shape:  # keys and values of two widths (latent attention's d_K, d_V): no stack
        tried = [layout for layout in tried if not layout.startswith(STACKED)]
    shapes = [tuple(s) for s in (failure.shapes if failure is not None else [])]
    own = tuple(cache[0].shape)
    met = [s for s in shapes if s != own]

    def meets(layout: str) -> bool:
        shape = _shape(cache, layout, n_new)
        return any(len(s) == len(shape) and sum(a != b for a, b in zip(s, shape, strict=True)) <= 1 for s in met)

    keyed = failure is not None and failure.message.startswith(("KeyError", "TypeError: tuple indices"))
    # a key the pair cannot answer (XLM's cache["slen"]): the dict first
    return sorted(tried, key=lambda layout: (layout.startswith(ROOM), keyed != layout.startswith(KEYED),
                                             not meets(layout)))


def heads_met(failure: Failure | None, sizes: dict[str, int]) -> int | None:
    """The key/value heads of the new keys the code writes into its cache, where the op it raised on met them in
    another count than trace's cache holds: a tensor [n_batch, .., d_head] holding n_Q (the new positions) and one
    more axis, a count of heads that divides n_head (gemma_pytorch's `k_cache.index_copy_(1, indices, xk)`, xk
    [n_batch, n_Q, n_kv_head, d_head], where a fused projection said no n_kv_head before a run); None otherwise."""
    n_head, d_head, n_Q = sizes.get("n_head"), sizes.get("d_head"), sizes.get("n_Q")
    if failure is None or not n_head or not d_head or not n_Q:
        return None
    held = sizes.get("n_kv_head", n_head)
    for shape in failure.shapes:
        if len(shape) != 4 or shape[0] != sizes.get("n_batch") or shape[-1] != d_head or n_Q not in shape[1:3]:
            continue
        rest = list(shape[1:3])
        rest.remove(n_Q)
        if rest[0] != held and 0 < rest[0] < n_head and n_head % rest[0] == 0:
            return int(rest[0])
    return None


def join(records: list[Record], parameter: str | None = None) -> tuple[Record, int] | None:
    """The code's torch.cat of a cache input (`parameter`'s, else any input's) with a tensor of its own, and the axis
    it joins on as written (`dim=1`, or the second argument): None where the code joins none."""
    for r in records:
        parts = next((v for k, v in r.args if k == "list"), None) if r.func == "cat" else None
        if not parts or not any(k == "rec" for k, _ in parts):
            continue
        inputs = [str(v) for k, v in parts if k == "text"]
        if not inputs or (parameter is not None and not any(v == parameter or v.startswith(f"{parameter}[")
                                                             for v in inputs)):
            continue
        written = [str(v) for k, v in r.args if k == "text"]
        dim = next((w.removeprefix("dim=") for w in written if w.startswith("dim=")), written[0] if written else "0")
        if dim.lstrip("-").isdigit():
            return r, int(dim)
    return None


def read(records: list[Record], parameter: str, layout: str,
         cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[str, str] | None:
    """The layout the code's own join says where it is not `layout` and the two hand one shape (so the code ran on
    either): the one whose positions' axis is the axis the code joins on, and the note that says so. None where the
    join agrees or says none."""
    found = join(records, parameter)
    if found is None:
        return None
    record, dim = found
    rank = record.tensor.dim()
    if rank == 0 or DIMS[layout].index("n_cache") == dim % rank:
        return None
    shape = _shape(cache, layout)
    other = next((other for other, dims in DIMS.items() if len(dims) == rank and dims.index("n_cache") == dim % rank
                  and _shape(cache, other) == shape), None)
    if other is None:
        return None
    return other, (f"{parameter}: your code keeps its cache as {words(other)}: it joins it on that layout's axis of "
                   f"positions (line {record.line}: {record.call}(.., dim={dim})), where {words(layout)} is one "
                   f"shape with it at these sizes; it is handed that one. A convention, not a mistake: the reference "
                   "reads the same keys and values")


def note(layout: str, failure: Failure | None, parameters: tuple[str, ...]) -> str:
    where = f" (line {failure.line}: {failure.message})" if failure is not None and failure.line else ""
    return (f"{', '.join(parameters)}: your code keeps its cache as {words(layout)}; it raised on the pair (K_cache, "
            f"V_cache), each laid out {words('bhnd')}{where}, and runs on this one, which it is handed. A convention, "
            "not a mistake: the reference reads the same keys and values")
