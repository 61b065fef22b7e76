"""Olmo2 <- QkNormed, Llama <- Family

OLMo 2: LLaMA's keys and attention (llama.py), with qk-norm over the whole projection and norms after, not
before, each sublayer.

- q and k are RMSNormed before the split into heads, over all n_head·d_head (keys: n_kv_head·d_head) coordinates
  at once, with weights as wide (`Olmo2Attention`: `q_norm = Olmo2RMSNorm(num_attention_heads * head_dim)`):

      layers.L.self_attn.q_norm.weight  [n_head·d_head]      head h's share: rows h·d_head ... (h+1)·d_head - 1
      layers.L.self_attn.k_norm.weight  [n_kv_head·d_head]   the KV head g = h // n_group: rows g·d_head ...

  so one mean runs over every head: head h's normed q depends on the other heads' coordinates too.
- A layer (`Olmo2DecoderLayer`) has no norm before its attention or MLP, but one after each:
  `h = h + post_attention_layernorm(attention(h))`, `h = h + post_feedforward_layernorm(mlp(h))`; the
  attention reads the residual stream itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.models.families.llama import Llama
from attnscope.models.families.qknormed import QkNormed
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    import torch

    from attnscope.attention.multihead import MultiHeadAttention


class Olmo2(QkNormed, Llama):
    model_types = ("olmo2",)
    norm_over = "proj"

    # --- where head h lives ---------------------------------------------------------------------------------

    def mlp_biased(self) -> bool:
        return False  # Olmo2MLP has no biases

    # --- the attention's specifics --------------------------------------------------------------------------

    def attention_spec(self, layer: int) -> AttentionSpec:
        return AttentionSpec(causal=True, rope=self.rope(), qk_norm=self.qk_norm())

    # --- the prefix -----------------------------------------------------------------------------------------

    def attention_input(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, str]:
        return h, f"h: the residual stream entering layer {layer} (OLMo 2 norms after the attention, not before)"

    def block(self, layer: int, h: torch.Tensor, attention: MultiHeadAttention) -> torch.Tensor:
        h = h + self.norm(layer, "post_attention_layernorm", attention(h)["x"])
        return h + self.norm(layer, "post_feedforward_layernorm", self.mlp(layer, h))
