"""Qwen2 <- Llama <- Family

Qwen2: LLaMA's layout and forward (llama.py), with biases on q, k and v (never o: `Qwen2Attention`), and a
sliding window of `sliding_window` keys on the "sliding_attention" layers when `use_sliding_window` is on:
`layer_types`, or from `max_window_layers` on where an older config has no `layer_types`."""

from __future__ import annotations

from attnscope.models.families.llama import Llama


class Qwen2(Llama):
    model_types = ("qwen2",)

    def biases(self) -> tuple[bool, bool]:
        return True, False

    def mlp_biased(self) -> bool:
        return False

    def window(self, layer: int) -> int | None:
        if not self.config.flag("use_sliding_window"):
            return None  # Qwen2Config sets sliding_window to None then
        sliding = self.layer_type(layer) == "sliding_attention"
        return self.config.optional_integer("sliding_window") if sliding else None

    def layer_type(self, layer: int) -> str:
        """`layer_types[layer]`, or Qwen2Config's default: sliding from `max_window_layers` on."""
        kinds = self.config.str_list("layer_types", self.n_layer)
        if kinds is not None:
            return kinds[layer]
        first = self.config.integer("max_window_layers", default=28, minimum=0)
        return "sliding_attention" if layer >= first else "full_attention"
