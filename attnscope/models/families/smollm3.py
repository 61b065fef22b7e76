"""SmolLM3 <- Llama <- Family

SmolLM3: LLaMA's keys, layout and forward (llama.py), with NoPE layers: every `no_rope_layer_interval`-th
layer (4: layers 3, 7, 11, ...), or those `no_rope_layers` marks 0, rotate nothing (nope.py), so their
scores see positions only through the causal mask (transformers' `SmolLM3Attention`: `if self.use_rope:
apply_rotary_pos_emb`). Layers whose `layer_types` entry is "sliding_attention" see a window of `sliding_window`
keys (the eager mask is `create_sliding_window_causal_mask` there; SmolLM3Config makes the NoPE layers the
sliding ones when `use_sliding_window` is on and it writes `layer_types` itself). Biases as LLaMA's:
q/k/v/o when `attention_bias`, the MLP's when `mlp_bias`.

    model.layers.L.self_attn.{q,k,v,o}_proj.weight    as LLaMA's (head h: rows h·d_head ... of q_proj)
"""

from __future__ import annotations

from attnscope.errors import UsageError
from attnscope.models.families.llama import Llama
from attnscope.models.families.nope import nope_note, rope_layers
from attnscope.spec import AttentionSpec


class SmolLM3(Llama):
    model_types = ("smollm3",)

    # --- the attention's specifics --------------------------------------------------------------------------

    def uses_rope(self, layer: int) -> bool:
        return rope_layers(self.config, self.n_layer)[layer]

    def layer_type(self, layer: int) -> str:
        """`layer_types[layer]`, or SmolLM3Config's default: sliding on the NoPE layers when
        `use_sliding_window` and `sliding_window` are set, else full."""
        kinds = self.config.str_list("layer_types", self.n_layer)
        if kinds is not None:
            return kinds[layer]
        sliding = (self.config.flag("use_sliding_window") and self.config.has("sliding_window")
                   and not self.uses_rope(layer))
        return "sliding_attention" if sliding else "full_attention"

    def window(self, layer: int) -> int | None:
        if self.layer_type(layer) != "sliding_attention":
            return None
        window = self.config.optional_integer("sliding_window")
        if window is None:
            raise UsageError(f"{self.config.path}: layer_types makes layer {layer} sliding_attention but "
                             "sliding_window is not set; fix config.json")
        return window

    def attention_spec(self, layer: int) -> AttentionSpec:
        return AttentionSpec(causal=True, rope=self.rope() if self.uses_rope(layer) else None,
                             window=self.window(layer))

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is not None:
            return super().notes(layer, head)
        return [] if self.uses_rope(layer) else [nope_note(layer)]
