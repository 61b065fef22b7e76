"""Gemma2 <- Llama <- Family

Gemma 2: LLaMA's keys and attention, with what Gemma changes.

- `head_dim` is its own setting, not `hidden_size / num_attention_heads` (Gemma 2 2B: 8 heads of 256 on a
  width of 2304), so q_proj is `[n_head·head_dim, d_model]`, wider or narrower than d_model.
- Scores are scaled by `query_pre_attn_scalar ** -0.5`, then soft-capped: `softcap · tanh(scores / softcap)`
  with `attn_logit_softcapping` (50).
- Layers alternate: `layer_types` (default: even layers "sliding_attention") take a sliding window of
  `sliding_window` keys; the others see every earlier key.
- RMSNorm scales by `(1 + w)` (its weights are stored as offsets from 1), and each layer has four: before
  and after the attention, before and after the MLP ("sandwich" norms).
- The token embedding is multiplied by `sqrt(hidden_size)`; the MLP is GeGLU (`gelu_pytorch_tanh`).

A layer (`Gemma2DecoderLayer`): `h = h + post_attention_layernorm(attention(input_layernorm(h)))`, then
`h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from attnscope.models.families.llama import Llama
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    import torch

    from attnscope.attention.multihead import MultiHeadAttention


class Gemma2(Llama):
    model_types: ClassVar[tuple[str, ...]] = ("gemma2",)
    norm_plus_one = True
    ties_by_default = True  # Gemma2Config's tie_word_embeddings
    activation_keys = ("hidden_activation", "hidden_act")  # Gemma2MLP reads hidden_activation

    # --- where head h lives ---------------------------------------------------------------------------------

    def biases(self) -> tuple[bool, bool]:
        on = self.config.flag("attention_bias")
        return on, on

    def mlp_biased(self) -> bool:
        return False  # Gemma2MLP has no biases

    # --- the attention's specifics --------------------------------------------------------------------------

    def window(self, layer: int) -> int | None:
        kinds = self.config.str_list("layer_types", self.n_layer)
        sliding = kinds[layer] == "sliding_attention" if kinds is not None else (layer + 1) % 2 == 1
        return self.config.optional_integer("sliding_window") if sliding else None

    def attention_spec(self, layer: int) -> AttentionSpec:
        scalar = self.config.number("query_pre_attn_scalar", default=256)
        # Gemma2Model builds causal masks whatever `use_bidirectional_attention` says, so eager is causal.
        return AttentionSpec(causal=True, rope=self.rope(), window=self.window(layer),
                             softcap=self.config.optional_number("attn_logit_softcapping"), scale=scalar ** -0.5)

    # --- the prefix -----------------------------------------------------------------------------------------

    def embed(self, ids: list[int], type_ids: list[int]) -> torch.Tensor:
        """`Gemma2TextScaledWordEmbedding`: the rows times sqrt(hidden_size)."""
        return super().embed(ids, type_ids) * math.sqrt(self.d_model)  # [1, n_tokens, d_model]

    def attention_input(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, str]:
        return (self.norm(layer, "input_layernorm", h),
                f"input_layernorm(h): (1 + w) RMSNorm of the residual stream entering layer {layer}")

    def block(self, layer: int, h: torch.Tensor, attention: MultiHeadAttention) -> torch.Tensor:
        x = attention(self.attention_input(layer, h)[0])["x"]
        h = h + self.norm(layer, "post_attention_layernorm", x)
        x = self.mlp(layer, self.norm(layer, "pre_feedforward_layernorm", h))
        return h + self.norm(layer, "post_feedforward_layernorm", x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`Gemma2ForCausalLM`: LLaMA's head, then `final_logit_softcapping` (30) as `c · tanh(logits / c)`."""
        logits = super().logits(h)
        cap = self.config.optional_number("final_logit_softcapping")
        return logits if cap is None else cap * (logits / cap).tanh()
