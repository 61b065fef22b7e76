"""What the forward's other parameters are given: a decode step's cache and first position (--cache N), and
RoPE's tables (--rope), each in the form the code that passes them in writes it.

- a cache (`kv_cache`, `past_key_value`, `layer_past`, ...): the tuple `(K_cache, V_cache)`, each
  `[n_batch, n_kv_head, n_cache, d_head]`, keys already rotated (transformers' caches hold them so); in the layout
  the code keeps, where it raised on that one (cachelayouts.py: sequence-major, folded, time-first, stacked, or
  transformers' Cache object);
- a first position (`start_pos`, `offset`, `past_length`, ...): n_cache (0 without --cache); the new positions as
  a tensor (gpt-fast's `input_pos`, transformers' `cache_position`): arange(n_cache, n_cache + n_Q);
- `cos`, `sin`: `[n_pos, d_head]` for positions 0 .. n_K - 1, half-split (`cat(freqs, freqs)`), as
  LLMs-from-scratch's `compute_rope_params` makes them; the code slices its positions out;
- `freqs_cis`: complex `[n_Q, d_head / 2]` for the new positions, as Meta's `precompute_freqs_cis` sliced by
  `Transformer.forward` (`freqs_cis[start_pos : start_pos + seqlen]`);
- `freqs_cos`, `freqs_sin`: `[n_Q, d_head / 2]`, the real and imaginary parts of `freqs_cis`, as llama2.c's
  `precompute_freqs_cis` makes them and its `Transformer.forward` slices them (`freqs_cos[:seqlen]`);
- `rotary_pos_emb`: the angles position · inv_freq, `[n_Q, d_head / 2]`, as Qwen2-VL's VisionRotaryEmbedding makes
  them for its vision tower (which takes their cos and sin);
- a position bias (`position_bias`, T5's): --position-bias's tensor, `[.., n_Q, n_K]` as the file holds it;
- ALiBi's bias handed in (BLOOM's `alibi`; under --alibi MPT's `position_bias`, llm-foundry's `attn_bias`): the
  reference's ALiBi in the layout the code reads (alibifeed.py);
- `position_embeddings`: `(cos, sin)`, each `[n_batch, n_Q, d_head]` for the new positions, as transformers'
  `LlamaRotaryEmbedding` hands them to `LlamaAttention.forward` (`[n_Q, d_head]` where the inputs have no batch
  axis: Qwen2-VL's vision tower).
The tables use the reference's base (--rope-base, else the module's own rope_theta), so what they cannot tell apart
is the user's pairing and slicing, which is what the diagnoses look at. Where the code rotates a share of each head
(StableLM's partial_rotary_factor), they are as wide as that share, as its model hands them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    import torch

    from attnscope.usertrace.inputs import Inputs
    from attnscope.usertrace.load import Plan


@dataclass
class Feeds:
    values: dict[str, Any] = field(default_factory=dict)  # parameter -> what it is given
    steps: list[tuple[str, torch.Tensor, tuple[str, ...], str]] = field(default_factory=list)  # shown as inputs
    labels: dict[int, str] = field(default_factory=dict)  # id(tensor) -> how ops name it


@dataclass(frozen=True)
class TableForm:
    """RoPE's tables as the code runs on them, read where it raised on trace's first ones (runs/trace.py): `width`
    wide, holding one angle a pair (`pairs`: [.., d_head / 2], the frequencies over the whole head, as freqs_cis holds
    them: GPT-OSS's `_apply_rotary_emb` and nanochat's `apply_rotary_emb` broadcast them over each half of the head)
    or laid out for a pairing over that share of the head (a rotary fraction); laid along `axes` (the number of axes
    of the tensor the code multiplies them with, and its positions' axis: nanochat's [1, n_Q, 1, width] for q
    [n_batch, n_Q, n_head, d_head / 2]), else as the parameter's kind lays them."""

    width: int
    pairs: bool = False
    axes: tuple[int, int] | None = None
    # what a parameter that takes the whole table is given, where the code runs on another form than its name says
    # (tableforms.holders): "complex" [n_Q, d_head / 2] (Meta's freqs_cis), "complex, batched" [n_batch, n_Q,
    # d_head / 2] (Llama 4's), "cos, sin" the pair (transformers' position_embeddings); "": as the name says
    holds: str = ""
    # the pair's layout over its share (tablelayouts.py): "interleaved" for `repeat_interleave(freqs, 2)` (Cohere's),
    # "" for the reference's pairing (half-split, `cat((freqs, freqs))`); `swapped`: the pair handed (sin, cos), as
    # GPT-J's `sin, cos = position_embeddings` takes it
    layout: str = ""
    swapped: bool = False
    # the pairing the code turns the pair in where it lays the tables out itself: "interleaved" for code that takes
    # the first half of `cat((freqs, freqs))` tables and repeat_interleaves it (GLM's, Helium's apply_rotary_pos_emb):
    # the tables are made half-split, and the reference pairs interleaved (tablelayouts.py)
    turned: str = ""


def feeds(plan: Plan, inputs: Inputs, rope_base: float | None, pairing: str = "half-split",
          position_bias: torch.Tensor | None = None, rope_width: int | None = None,
          form: TableForm | None = None) -> Feeds:
    """What the forward's other parameters get; RoPE's tables `rope_width` wide where the code rotates only that
    share of each head (its config's partial_rotary_factor, or the width its code slices), else d_head wide; in
    `form` where the code was read to run on another (one angle a pair, laid along its own axes)."""
    import torch

    out = Feeds()
    sizes = inputs.sizes
    if plan.bias is not None:
        if position_bias is None and plan.bias_required:
            raise UsageError(f"{plan.bias}: your code adds a position bias to the scores; give the one it is meant "
                             "to add with --position-bias FILE ([.., n_Q, n_K], T5's), or pass --alibi where it is "
                             "ALiBi's")
        out.values[plan.bias] = position_bias
        if position_bias is not None:
            from attnscope.usertrace import biasfile

            biasfile.check(position_bias, sizes)  # before the code meets it
            bias = position_bias.to(next(iter(inputs.tensors.values())).dtype)
            out.values[plan.bias] = bias
            out.steps.append((plan.bias, bias, (*("?",) * (bias.dim() - 2), "n_Q", "n_K"),
                              "input: --position-bias, added to the scores"))
            out.labels[id(bias)] = plan.bias
    _alibi(plan, inputs, out)
    n_cache = sizes.get("n_cache", 0)
    if plan.cache is not None:
        out.values[plan.cache] = inputs.cache
        cache = inputs.cache if inputs.cache is not None or not inputs.empty_cache else _empty(inputs)
        if cache is not None:
            from attnscope.usertrace.cachelayouts import ROOM, dims_of, handed, held

            layout = inputs.cache_layout  # the layout the code keeps it in
            parts = tuple(held(t, layout, keys=i == 0, n_new=sizes["n_Q"]) for i, t in enumerate(cache))
            apart = plan.cache_values is not None  # two parameters, the keys and the values (cacheforms.py)
            # the pair (answering a dict's keys too), one tensor stacking or joining it, or a Cache object
            given = parts if apart else handed(parts, inputs.cache_layout, inputs.cache_slots)
            out.values[plan.cache] = given[0] if apart else given
            if apart:
                out.values[str(plan.cache_values)] = given[1]
            if isinstance(given, torch.Tensor):
                out.labels[id(given)] = plan.cache
            heads = "n_kv_head" if "n_kv_head" in sizes else "n_head"
            for i, (name, tensor) in enumerate(zip(("K_cache", "V_cache"), parts, strict=True)):
                dims = tuple(d.replace("n_kv_head", heads) for d in dims_of(layout, i == 0) if d != "2")
                what = "random keys, taken as already rotated" if i == 0 else "random values"
                if inputs.cache is None:
                    what = f"no cached {'keys' if i == 0 else 'values'}" + (
                        ", room for the new ones (zero)" if int(tensor.numel()) else "")
                elif layout.startswith(ROOM):
                    what += ", then room for the new ones (zero)"
                label = (plan.cache, plan.cache_values)[i] if apart else f"{plan.cache}[{i}]"
                out.steps.append((name, tensor, dims, f"input: {label}, {what}"))
                out.labels[id(tensor)] = str(label)
    for name in plan.positions:
        out.values[name] = n_cache
    for name in plan.position_tensors:  # gpt-fast's input_pos: the new tokens' positions, after the cached ones
        out.values[name] = torch.arange(n_cache, n_cache + sizes["n_Q"])
    for name in plan.position_rows:  # one row for each sequence, [n_batch, n_Q] (Griffin's segment_pos)
        out.values[name] = torch.arange(n_cache, n_cache + sizes["n_Q"]).repeat(sizes.get("n_batch", 1), 1)
    for name in plan.position_ids:  # transformers' model: position_ids = cache_position.unsqueeze(0)
        out.values[name] = torch.arange(n_cache, n_cache + sizes["n_Q"])[None]
    _embeddings(plan, inputs, out)
    if not plan.tables or rope_base is None:
        return out
    from attnscope.usertrace.load import PAIR_TABLES, table_kind
    from attnscope.variants.rope import Rope

    d_head = sizes.get("d_head", sizes.get("d_K", 0))
    dtype = next(iter(inputs.tensors.values())).dtype
    n_pos, n_Q = sizes["n_K"] if plan.self_attention else max(sizes["n_Q"], sizes["n_K"]), sizes["n_Q"]
    if not d_head:  # never tables of width 0: the head count is what is missing
        raise UsageError("cannot tell d_head, so RoPE's tables cannot be made; pass --heads")
    if form is not None and form.pairs:  # one angle a pair, the frequencies over the whole head
        share = min(2 * form.width, d_head)  # the share it turns, the whole head or GPT-J's rotary_dim
        freq_width = share  # the width the frequencies are spread over
        angle = torch.arange(n_pos, dtype=torch.float32)[:, None] * Rope(rope_base).inv_freq(share)
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)  # [n_pos, share / 2]
    else:
        d_head = (form.width if form is not None else rope_width) or d_head  # the share the code rotates
        freq_width = d_head
        pairing = form.layout or ("half-split" if form.turned else pairing) if form is not None else pairing
        cos, sin = Rope(rope_base, pairing=pairing).cos_sin(n_pos, d_head, dtype)  # [n_pos, d_head]
    width = cos.shape[-1]
    start = n_cache
    for name in plan.tables:
        kind = table_kind(name) or name.lower()
        if form is not None and form.holds and (kind in WHOLE_TABLES or name in plan.read_tables):  # the form the
            # code was read to run on
            kind = "position_embeddings" if form.holds.startswith("cos, sin") else "freqs_cis"
        value: Any
        if form is not None and form.holds.startswith("matrices"):  # 2x2 rotation matrices (Flux's pe)
            from attnscope.usertrace.rotations import MATRICES, rotations

            value = rotations(cos[start:start + n_Q], sin[start:start + n_Q], form.holds, sizes.get("n_batch", 1))
            out.steps.append((name, value, MATRICES[form.holds], "input: [[cos, -sin], [sin, cos]] of "
                              f"position·inv_freq, positions {start} to {start + n_Q - 1}, base {rope_base:g}"))
        elif form is not None and form.axes is not None:  # laid along the axes of the tensor the code turns
            shape = [1] * form.axes[0]
            shape[form.axes[1]], shape[-1] = n_Q, width
            laid = (cos[start:start + n_Q].reshape(shape), sin[start:start + n_Q].reshape(shape))
            value = (laid[::-1] if form.swapped else laid) if kind not in ("cos", "sin") else \
                laid[0] if kind == "cos" else laid[1]
            for i, part in enumerate(value if isinstance(value, tuple) else ()):
                out.labels[id(part)] = f"{name}[{i}]"
        elif kind == "rotary_pos_emb_list":  # Qwen-1's: [(cos, sin)], each [1, n_Q, 1, width], sliced to the last
            # cur_len positions and turned as rotate_half turns them
            pair = tuple(t[start:start + n_Q][None, :, None, :] for t in (cos, sin))
            value = [pair]
            for i, part in enumerate(pair):
                out.labels[id(part)] = f"{name}[0][{i}]"
            out.steps.append((name, pair[0], ("1", "n_Q", "1", "d_head"), f"input: [(cos, sin)] of position · "
                              f"inv_freq, positions {start} to {start + n_Q - 1}, base {rope_base:g}, {pairing} "
                              "(Qwen-1's rotary_pos_emb_list)"))
        elif kind in ("cos", "sin"):
            value = cos if kind == "cos" else sin
            out.steps.append((name, value, ("n_K", "d_head"), f"input: {kind}(position · inv_freq), positions 0 to "
                              f"{n_pos - 1}, base {rope_base:g}, {pairing}"))
        elif kind in PAIR_TABLES:
            angle = (torch.arange(n_pos, dtype=torch.float32)[:, None] * Rope(rope_base).inv_freq(freq_width))[
                start:start + n_Q]  # [n_Q, d_head / 2], or the share the code turns
            source = {"freqs_cis": "Meta's precompute_freqs_cis", "rotary_pos_emb": "Qwen2-VL's VisionRotaryEmbedding"
                      }.get(kind, "llama2.c's precompute_freqs_cis")
            axes: tuple[str, ...] | None = None  # the table's dims where its form says them, else by its rank
            if kind == "freqs_cis":
                value, said = torch.polar(torch.ones_like(angle), angle), "e^(i·position·inv_freq)"
                if form is not None and form.holds == "complex, batched":  # one table a sequence (Llama 4's)
                    value = value.expand(sizes.get("n_batch", 1), *value.shape)
                if form is not None and form.holds == "real":  # gpt-fast's: stack([cos, sin], -1), [n_Q, d / 2, 2]
                    value, said = torch.view_as_real(value).to(dtype), "e^(i·position·inv_freq) as (cos, sin)"
                    axes = ("n_Q", "d_head/2", "2")
            elif kind == "rotary_pos_emb":  # the angles themselves, the code takes their cos and sin
                value, said = angle.to(dtype), "position·inv_freq"
            else:  # llama2.c's two real tables, freqs_cis's real and imaginary parts
                value, said = (angle.cos() if kind == "freqs_cos" else angle.sin()), f"{kind[-3:]}(position·inv_freq)"
            out.steps.append((name, value, axes or ("n_batch", "n_Q", "d_head/2")[3 - value.dim():], f"input: {said}, "
                              f"positions {start} to {start + n_Q - 1}, base {rope_base:g} ({source})"))
        else:  # position_embeddings
            # [n_batch, n_Q, width]; without a batch axis (--batch 0: Qwen2-VL's vision tower, [seq, dim]) [n_Q, width]
            batch = (sizes["n_batch"], n_Q, width) if "n_batch" in sizes and not (
                form is not None and form.holds == "cos, sin, shared") else (n_Q, width)
            value = (cos[start:start + n_Q].expand(batch), sin[start:start + n_Q].expand(batch))
            value = value[::-1] if form is not None and form.swapped else value
            for i, part in enumerate(value):
                out.labels[id(part)] = f"{name}[{i}]"
        out.values[name] = value
        if not isinstance(value, tuple):
            out.labels[id(value)] = name
    return out


# the parameters that take RoPE's whole table in one value (a complex table, or the pair (cos, sin))
WHOLE_TABLES = ("freqs_cis", "position_embeddings")


def _alibi(plan: Plan, inputs: Inputs, out: Feeds) -> None:
    """ALiBi's bias handed in by the model (BLOOM's `alibi`), in the plan's layout (alibifeed.py)."""
    from attnscope.usertrace import alibifeed

    if plan.alibi is None:
        return
    given = alibifeed.feed(plan, inputs.sizes, next(iter(inputs.tensors.values())).dtype)
    out.values[plan.alibi] = None if given is None else given[0]
    if given is not None:
        out.steps.append((plan.alibi, *given))
        out.labels[id(given[0])] = plan.alibi


def _empty(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cache of no cached positions, [n_batch, n_kv_head, 0, d_head] (None where the sizes do not say its shape)."""
    import torch

    sizes = inputs.sizes
    heads = sizes.get("n_kv_head", sizes.get("n_head"))
    if heads is None or "d_head" not in sizes:
        return None
    dtype = next(iter(inputs.tensors.values())).dtype
    shape = (sizes.get("n_batch", 1), heads, 0, sizes["d_head"])
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


# The shapes a relative position embedding takes, tried in turn where the code raises on the input's own (ESPnet's
# RelPositionMultiHeadedAttention: pos_emb [1, 2·T-1, d], relative positions T-1 .. -(T-1)): form -> its dims
RELATIVE: dict[str, tuple[str, ...]] = {
    "relative": ("1", "2·n_Q-1", "d_feat"), "relative, batched": ("n_batch", "2·n_Q-1", "d_feat"),
    "one for the batch": ("1", "n_Q", "d_feat")}
# ... and beside time-first inputs [n, n_batch, d]: Transformer-XL's r [klen, 1, d] (distances klen-1 .. 0, its
# pos_emb of klen positions), XLNet's pos_emb [qlen + klen, n_batch, d] (distances klen .. -(qlen-1)), and one of
# both signs, [2·T-1, 1, d]
TIME_RELATIVE: dict[str, tuple[str, ...]] = {
    "relative, time-first": ("n_Q", "1", "d_feat"), "relative, time-first, both ways": ("2·n_Q", "n_batch", "d_feat"),
    "relative, time-first, one each": ("2·n_Q-1", "1", "d_feat")}
# the distances each length of positions holds, for the note on the input
DISTANCES = {"2·n_Q-1": "relative positions {m} .. -{m}", "2·n_Q": "relative positions {n} .. -{m}",
             "n_Q": "distances {m} .. 0"}


def embedding_forms(layout: str) -> dict[str, tuple[str, ...]]:
    """The relative embedding forms tried for inputs in `layout` (none but the input's own in the others)."""
    return RELATIVE if layout == "row" else TIME_RELATIVE if layout == "time" else {}


def _embeddings(plan: Plan, inputs: Inputs, out: Feeds) -> None:
    """A random position embedding for each parameter that takes one (DETR's object_queries, SAM's key_pe): the
    shape of the input it is added to (x's, [n_batch, n, d_feat] or time-first), the memory's where its name says
    the keys' side (left at its default None in self-attention, where no memory is fed); in a relative embedding's
    form where the plan says one (RELATIVE, TIME_RELATIVE)."""
    import torch

    from attnscope.usertrace.inputs import role_dims
    from attnscope.usertrace.load import embedding_side

    by_role = {role: name for name, role in inputs.roles.items()}
    forms = embedding_forms(inputs.layout)
    for i, name in enumerate(plan.embeddings):
        keys = embedding_side(name) == "n_K"
        if plan.self_attention and keys and name not in plan.embeddings_required:
            continue  # the memory's (DETR's spatial_position_embeddings): None where no memory is fed
        role = "K" if keys and "K" in by_role else "Q"
        x = inputs.tensors[by_role[role]]
        generator = torch.Generator().manual_seed(1000 + i)
        dims = role_dims(role, inputs.sizes, "d_feat" in inputs.sizes, inputs.layout)
        shape, what = tuple(x.shape), "a random position embedding"
        if plan.embedding_form in forms and x.dim() == 3:
            dims = forms[plan.embedding_form]
            n, n_batch = (x.shape[0], x.shape[1]) if inputs.layout == "time" else (x.shape[1], x.shape[0])
            sizes = {"1": 1, "n_batch": n_batch, "n_Q": n, "2·n_Q-1": 2 * n - 1, "2·n_Q": 2 * n, "d_feat": x.shape[-1]}
            shape = tuple(sizes[d] for d in dims)
            length = next(d for d in dims if "n_Q" in d)
            said = DISTANCES.get(length, "").format(n=n, m=n - 1)
            what = f"a random {plan.embedding_form} position embedding" + (f" ({said})" if said else "")
        value = torch.randn(*shape, generator=generator, dtype=x.dtype)
        out.values[name] = value
        out.labels[id(value)] = name
        out.steps.append((name, value, dims, f"input: {name}, {what}"))
