"""Qwen3 <- QkNormed, Qwen2 <- Llama <- Family

Qwen3: LLaMA's layout and forward (llama.py) with qk-norm per head (qknormed.py), and Qwen2's windows
(qwen2.py).

Checkpoint keys, under `model.` in `Qwen3ForCausalLM`, bare in `Qwen3Model`: LLaMA's, and two more per layer:

    layers.L.self_attn.q_norm.weight  [d_head]   one RMSNorm weight that every query head shares
    layers.L.self_attn.k_norm.weight  [d_head]   and every key head

The attention (`Qwen3Attention`): project, split into heads, RMSNorm each head's q and k over its d_head
coordinates with those weights (steps `Q_normed`, `K_normed`; TransformerLens' `hook_q_normed`), then RoPE,
then LLaMA's attention; biases on q, k, v and o only when `attention_bias`; `head_dim` is its own setting
(128 by default, `Qwen3Config`), so Qwen3-0.6B's 16 heads of 128 project a width of 1024 to 2048. Sliding
windows as Qwen2's: `layer_types`, or from `max_window_layers` on, only with `use_sliding_window`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.models.families.qknormed import QkNormed
from attnscope.models.families.qwen2 import Qwen2
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    from pathlib import Path

    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.config import Config


class Qwen3(QkNormed, Qwen2):
    model_types = ("qwen3",)
    default_head_dim: int | None = 128  # Qwen3Config's head_dim when config.json leaves it out

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        super().__init__(folder, config, checkpoint)
        if self.default_head_dim is not None:
            self.d_head = config.integer("head_dim", default=self.default_head_dim)

    # --- where head h lives ---------------------------------------------------------------------------------

    def biases(self) -> tuple[bool, bool]:
        """`Qwen3Attention`: q, k, v and o all take `attention_bias` (Qwen2's q/k/v biases are gone)."""
        on = self.config.flag("attention_bias")
        return on, on

    # --- the attention's specifics --------------------------------------------------------------------------

    def attention_spec(self, layer: int) -> AttentionSpec:
        return AttentionSpec(causal=True, rope=self.rope(), window=self.window(layer), qk_norm=self.qk_norm())
