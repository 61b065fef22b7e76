"""The checkpoint's shapes against what config.json implies, read from the headers before anything is shown.

A config that disagrees with its weights (a `head_dim`, a number of key/value heads or a width that is not
the checkpoint's) would otherwise have head h shown as the wrong rows without a word (a Gemma 2 folder whose
head_dim is 8 where the weights have 16 showed rows 24:32 as head 3), or fail inside PyTorch with `size
mismatch` once a text runs. transformers refuses the same folders when it loads them
(`PreTrainedModel._load_pretrained_model` reports mismatched sizes); attnscope reads only slices, so it
checks here, from the headers, once, when the family is opened (`families.open_model`, after the family's own
construction has read its sizes).

What a family implies, from its own protocol: each weight of head h is a slice (`head_slices`), so along the
sliced axis a tensor holds as much as the last head's slice reaches (`n_head·d_head` rows of the query
projection, `n_kv_head·d_head` of the key and value projections, `3·d_model` columns of GPT-2's fused
`c_attn`, `(n_head + 2·n_kv_head)·d_head` rows of Phi-3's fused `qkv_proj`), and along the other axis
`d_model` (a latent rank for DeepSeek's up-projections, which name their axes and are checked along the
sliced one); a bias holds the first; the token embedding (the family's `embedding` key) is `[vocab, d_model]`.
Every layer is checked, as every layer up to L runs on a text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from attnscope.models.family import Family, Slice


def check_weights(model: Family) -> None:
    """Refuse, naming the tensor, its shape and what the config implies, the first weight whose shape is not what
    config.json says. Keys the checkpoint lacks are left to the reader, which names them when it needs them."""
    for layer in range(model.n_layer):
        for key, implied in implied_shapes(model, layer).items():
            _compare(model, key, implied)
    embedding = getattr(model, "embedding", "")
    key = f"{model.prefix}{embedding}"
    if embedding and key in model.checkpoint:
        shape = model.checkpoint.shape(key)
        if len(shape) != 2 or shape[1] != model.d_model:
            _refuse(model, key, shape, f"[vocab, {model.d_model}]")


def implied_shapes(model: Family, layer: int) -> dict[str, list[int | None]]:
    """Each attention weight of `layer` that head slices are read from, with the shape config.json implies."""
    reach: dict[str, Slice] = {}
    for part in model.head_slices(layer, model.layer_sizes(layer).n_head - 1):  # the last head reaches furthest
        if part.key not in reach or part.hi > reach[part.key].hi:
            reach[part.key] = part
    return {key: _implied(model, part) for key, part in reach.items()}


def _implied(model: Family, part: Slice) -> list[int | None]:
    """The sliced axis reaches `part.hi`; the other is d_model, or unchecked (None) where a slice names its
    axes (`Slice.dims`, MLA's latent weights) and the other is not d_model. One-axis weights (weights.HEAD_DIMS:
    biases, qk-norm weights, sinks) have only the sliced axis."""
    from attnscope.models.weights import HEAD_DIMS

    named = part.dims is not None
    dims = part.dims or HEAD_DIMS.get(part.name, ("", "d_model") if part.axis == "rows" else ("d_model", ""))
    if len(dims) == 1:  # a bias, a norm's weight, GPT-OSS's sinks: one axis, as long as the last head reaches
        return [part.hi]
    other = None if named and (dims[1] if part.axis == "rows" else dims[0]) != "d_model" else model.d_model
    return [part.hi, other] if part.axis == "rows" else [other, part.hi]


def _compare(model: Family, key: str, implied: list[int | None]) -> None:
    if key not in model.checkpoint:
        return
    shape = model.checkpoint.shape(key)
    fits = len(shape) == len(implied) and all(want in (None, got) for got, want in zip(shape, implied, strict=True))
    if not fits:
        _refuse(model, key, shape, str(implied).replace("None", "?"))


def _refuse(model: Family, key: str, shape: list[int], implied: str) -> None:
    from attnscope.models.source import source_of

    sizes = (f"num_attention_heads {model.n_head}, key/value heads {model.n_kv_head}, head_dim {model.d_head}, "
             f"hidden_size {model.d_model}")
    source = source_of(model.folder)
    raise UsageError(f"{{model}} {model.folder}: {key} is {shape} in {model.checkpoint.source.name}, but "
                     f"{source.settings_name} implies {implied} ({sizes}); the config does not describe these "
                     f"weights: {source.fix_advice}", "model")
