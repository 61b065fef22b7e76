"""Where a head lives in a checkpoint, and reading it: `head_weights` reads head h's slices only (lazily from
safetensors, through a memory map from a .bin), and the four-Linear layout most families share
(`linear_slices`, `linear_projections`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.models.family import Family, Slice, check_layer_head

if TYPE_CHECKING:
    import torch

    from attnscope.models.checkpoint import Array

HEAD_DIMS = {"W_Q": ("d_head", "d_model"), "W_K": ("d_head", "d_model"), "W_V": ("d_head", "d_model"),
             "b_Q": ("d_head",), "b_K": ("d_head",), "b_V": ("d_head",), "W_O": ("d_model", "d_head"),
             "sink": ("1",),  # GPT-OSS: head h's attention sink, sinks[h:h + 1]
             "q_norm": ("d_head",), "k_norm": ("d_head",)}


@dataclass
class HeadWeights:
    """W_Q, W_K, W_V `[d_head, d_model]`, their biases `[d_head]` where the family has them, and W_O
    `[d_model, d_head]`, and the qk-norm's weights `[d_head]` where the family has one (`q_norm`, `k_norm`), each
    with where it came from (`model.layers.0.self_attn.q_proj.weight[0:64, :]`)."""

    model: Family
    layer: int
    head: int
    tensors: dict[str, Array] = field(default_factory=dict)  # NumPy arrays where it could, else torch
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    dims: dict[str, tuple[str, ...]] = field(default_factory=dict)  # each weight's axes, named

    def as_torch(self) -> dict[str, torch.Tensor]:
        import torch

        return {name: t if isinstance(t, torch.Tensor) else torch.from_numpy(t.copy())
                for name, t in self.tensors.items()}


def head_weights(model: Family, layer: int, head: int) -> HeadWeights:
    """Read this head's slices only (from safetensors lazily, from a .bin through a memory map)."""
    check_layer_head(model, layer, head)
    result = HeadWeights(model, layer, head, notes=model.notes(layer, head))
    for part in model.head_slices(layer, head):
        tensor, text = model.checkpoint.slice(part.key, part.axis, part.lo, part.hi)
        if part.transpose and len(tensor.shape) == 2:
            tensor, text = tensor.T, f"{text}.T"  # [in, out] -> [out, in]
        result.tensors[part.name] = tensor
        named = getattr(model.checkpoint, "source_of", None)  # a GGUF names its own tensor and type
        result.sources[part.name] = named(part.key, text) if named else f"{part.key}{text}"
        result.dims[part.name] = part.dims or HEAD_DIMS[part.name]
    return result


def linear_slices(model: Family, layer: int, head: int, names: dict[str, str],
                  biases: tuple[bool, bool]) -> list[Slice]:
    """Head h in Linear weights stored `[out, in]`: rows of query/key/value (key/value rows of the KV head
    that serves h), columns of the output projection. `names` maps q, k, v, o to the layer's module names;
    `biases` says whether q/k/v and o have biases (the output bias is not per head, so it is not shown)."""
    d = model.d_head
    q, kv = head * d, head // model.n_group * d
    parts = [Slice("W_Q", model.key(layer, f"{names['q']}.weight"), "rows", q, q + d),
             Slice("W_K", model.key(layer, f"{names['k']}.weight"), "rows", kv, kv + d),
             Slice("W_V", model.key(layer, f"{names['v']}.weight"), "rows", kv, kv + d)]
    if biases[0]:
        parts += [Slice("b_Q", model.key(layer, f"{names['q']}.bias"), "rows", q, q + d),
                  Slice("b_K", model.key(layer, f"{names['k']}.bias"), "rows", kv, kv + d),
                  Slice("b_V", model.key(layer, f"{names['v']}.bias"), "rows", kv, kv + d)]
    parts.append(Slice("W_O", model.key(layer, f"{names['o']}.weight"), "cols", q, q + d))
    return parts


def linear_projections(model: Family, layer: int, names: dict[str, str]) -> dict[str, Any]:
    """MultiHeadAttention's W_q, W_k, W_v, W_o from four Linear layers of the checkpoint."""
    state = {}
    qkv, out = model.biases()
    for ours, theirs in (("W_q", names["q"]), ("W_k", names["k"]), ("W_v", names["v"]), ("W_o", names["o"])):
        state[f"{ours}.weight"] = model.weight(layer, f"{theirs}.weight")
        if out if ours == "W_o" else qkv:
            state[f"{ours}.bias"] = model.weight(layer, f"{theirs}.bias")
    return state


def norm_slices(model: Family, layer: int, head: int, names: dict[str, str], over: str) -> list[Slice]:
    """The qk-norm's weights as head h reads them (`names` maps q, k to the norms' module names): the whole
    `[d_head]` weight every head shares ("head"), or head h's rows of a weight as wide as the projection ("proj",
    OLMo 2: the rows of the KV head that serves h for the keys)."""
    d = model.d_head
    q, kv = (0, 0) if over == "head" else (head * d, head // model.n_group * d)
    return [Slice("q_norm", model.key(layer, f"{names['q']}.weight"), "rows", q, q + d),
            Slice("k_norm", model.key(layer, f"{names['k']}.weight"), "rows", kv, kv + d)]


def norm_projections(model: Family, layer: int, names: dict[str, str]) -> dict[str, Any]:
    """MultiHeadAttention's `q_norm.weight` and `k_norm.weight` from the checkpoint's norms, as stored (Gemma's
    offsets from 1 stay offsets: the module's QkNorm says `(1 + w)`)."""
    return {f"{ours}.weight": model.weight(layer, f"{names[part]}.weight")
            for ours, part in (("q_norm", "q"), ("k_norm", "k"))}
