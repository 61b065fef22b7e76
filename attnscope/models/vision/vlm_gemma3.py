"""Gemma 3 with an image: Gemma 3's text page (gemma3.py), each layer's mask the one `Gemma3Model` builds when
the processor gives `token_type_ids` (`create_masks_for_vision_model`): an image's tokens see each other both
ways, a text token sees the keys before it.

- full layers: `causal OR same image` (`create_causal_mask(..., block_sequence_ids=...)`);
- sliding layers: `(causal OR same image) AND kv > q - sliding_window` (`blockwise_overlay`, then
  `sliding_window_overlay`).

The mask is handed to the attention as data (a boolean `[n_tokens, n_tokens]`, True = may attend), so the
module's spec keeps RoPE, qk-norm and the scale and drops its own causal rule and window, which the mask holds;
the layer's spec as shown stays Gemma 3's (causal, its window), with a note on the image.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from attnscope.models.families.gemma3 import Gemma3

if TYPE_CHECKING:
    import torch

    from attnscope.spec import AttentionSpec


def image_mask(blocks: list[int], window: int | None) -> torch.Tensor:
    """`[n_tokens, n_tokens]` bool: causal, or both in the same image (`blocks[i]` its run, -1 for text), and within
    `window` keys back where the layer slides."""
    import torch

    block = torch.tensor(blocks)
    n = len(blocks)
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (kv <= q) | ((block[:, None] == block[None, :]) & (block[:, None] >= 0))  # [n_tokens, n_tokens]
    if window is not None:
        allowed &= kv > q - window
    return allowed


class Gemma3Image(Gemma3):
    """Gemma 3's text model reading a prompt with an image: `blocks` says which image each position is in (-1:
    text), as `ImageTokens.blocks` gives it."""

    blocks: list[int]
    _building = False  # while the module is built: its spec leaves causality and the window to the mask

    def attention_spec(self, layer: int) -> AttentionSpec:
        """The layer's own spec (causal, its window: what the table and JSON describe); the module's, while it
        is built, without them, as the mask it is called with holds both."""
        spec = super().attention_spec(layer)
        return replace(spec, causal=False, window=None) if self._building else spec

    def attention(self, layer: int, record: bool) -> Any:
        """Layer `layer`'s MultiHeadAttention, called with this layer's mask."""
        self._building = True
        try:
            module = super().attention(layer, record)
        finally:
            self._building = False
        return partial(module, mask=image_mask(self.blocks, self.window(layer))[None])  # [1, n_tokens, n_tokens]

    def layer_notes(self, layer: int) -> list[str]:
        window = self.window(layer)
        rule = "causal, or both in the same image" + (f", and at most {window - 1} keys back" if window else "")
        return [*super().layer_notes(layer),
                f"the mask Gemma3Model builds from token_type_ids (create_masks_for_vision_model): {rule}; each "
                "image's tokens see each other both ways"]
