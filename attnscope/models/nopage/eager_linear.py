"""`head --check`'s reference for a linear attention layer (Qwen3-Next's, Qwen3.5's, Kimi Linear's, MiniMax's):
transformers' own eager run of layers 0..L, hooked at the layer's module and at its gated norm's input, for what
runs/check_model.py holds a traced linear layer's x and effective_attention @ V against."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    import torch


def eager_linear(folder: Path, model_type: str, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own run of layers 0..`layer` on `ids` (`truncated.load`, eager, float32): linear layer
    `layer`'s output `[n_tokens, d_model]` and its recurrence's output before the gated norm `[n_tokens,
    n_head·d_V]` (the norm's input, hooked, heads merged): what `head --check` holds x and M @ V against."""
    import torch
    from transformers import AutoModel

    from attnscope.models.nopage import truncated

    truncated.quiet_transformers()
    full, n_layer = truncated.full_config(folder, model_type, layer)
    model = truncated.load(AutoModel, folder, truncated.cut(full, n_layer, layer), model_type, traced=False)
    inner = getattr(model, "language_model", model)  # Qwen3.5's multimodal model: its text model
    module = getattr(inner.layers[layer], "linear_attn", None) or inner.layers[layer].self_attn
    norm = getattr(module, "norm", None) or module.o_norm
    seen: dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_hook(lambda m, a, out: seen.__setitem__("x", out[0] if isinstance(out, tuple)
                                                                           else out)),
             norm.register_forward_hook(lambda m, a, out: seen.__setitem__("core", a[0]))]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)  # a cache of linear layers only: transformers fails
    finally:
        for hook in hooks:
            hook.remove()
    return seen["x"][0], seen["core"].reshape(len(ids), -1)  # [n_tokens, d_model], [n_tokens, n_head·d_V]
