"""Gemma3 <- QkNormed, Gemma2 <- Llama <- Family

Gemma 3 (text): Gemma 2's layout and forward (gemma2.py), with qk-norm per head (qknormed.py), a RoPE base
per layer type, no attention softcapping, and the text half of the multimodal checkpoints.

What changes from Gemma 2 (`Gemma3Attention`, `Gemma3TextModel`):
- q and k are RMSNormed per head over d_head before RoPE, in Gemma's `(1 + w)` form:

      layers.L.self_attn.q_norm.weight  [d_head]   offsets from 1, shared by every query head
      layers.L.self_attn.k_norm.weight  [d_head]

- Layers are "sliding_attention" (a window of `sliding_window` keys) or "full_attention": `layer_types`, or in
  older configs `sliding_window_pattern` (6: five sliding layers, then a full one). Each type has its own RoPE
  (`rope_parameters.full_attention` base 1M, `.sliding_attention` 10k; 4.4x configs: `rope_theta` and
  `rope_local_base_freq`, `rope_scaling` on the full layers only), read by `Rope.from_config`.
- Scores are scaled by `query_pre_attn_scalar ** -0.5` and never soft-capped: the config may still carry
  `attn_logit_softcapping`, but `Gemma3Attention` does not pass it to the attention (a note says so).
- Embedding scaled by sqrt(hidden_size), four `(1 + w)` RMSNorms per layer (sandwich), GeGLU: as Gemma 2.

`Gemma3ForCausalLM` and `Gemma3TextModel` checkpoints (model_type `gemma3_text`) keep the keys under `model.` or
bare; `Gemma3ForConditionalGeneration` (model_type `gemma3`, the 4B and larger) keeps the language model under
`language_model.model.` (`model.language_model.` as transformers 5 names it in memory) and its settings in
`text_config`, where keys equal to `Gemma3TextConfig`'s defaults are often left out: they are filled in here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from attnscope.errors import UsageError
from attnscope.models.config import Config
from attnscope.models.families.gemma2 import Gemma2
from attnscope.models.families.qknormed import QkNormed
from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    from pathlib import Path

    from attnscope.models.checkpoint import Checkpoint

# Gemma3TextConfig's defaults for what this page reads (tests/test_qknorm_families.py holds them equal).
TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "gemma3_text", "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
}
LAYER_TYPES = ("sliding_attention", "full_attention")


class Gemma3(QkNormed, Gemma2):
    model_types: ClassVar[tuple[str, ...]] = ("gemma3_text", "gemma3")
    prefixes: ClassVar[tuple[str, ...]] = ("model.", "", "language_model.model.", "model.language_model.")

    def __init__(self, folder: Path, config: Config, checkpoint: Checkpoint) -> None:
        self.model_type = config.model_type  # the checkpoint's own, not its text_config's (Family keeps it)
        text = dict(config.data)
        if config.model_type == "gemma3":  # Gemma3ForConditionalGeneration ties its head by its own config
            text = {**(config.mapping("text_config") or {}),
                    "tie_word_embeddings": config.data.get("tie_word_embeddings", True)}
        super().__init__(folder, Config(config.path, {**TEXT_DEFAULTS, **text}), checkpoint)
        self.architecture = config.architecture

    # --- the attention's specifics --------------------------------------------------------------------------

    def layer_type(self, layer: int) -> str:
        """`layer_types[layer]`, or `sliding_window_pattern`'s rule: sliding unless (layer + 1) is a multiple."""
        kinds = self.config.str_list("layer_types", self.n_layer)
        if kinds is None:
            pattern = self.config.integer("sliding_window_pattern", "_sliding_window_pattern", default=6)
            return "sliding_attention" if (layer + 1) % pattern else "full_attention"
        if kinds[layer] not in LAYER_TYPES:
            raise UsageError(f"{self.config.path}: layer_types[{layer}] is {kinds[layer]!r}; Gemma 3's layers are "
                             f"{' or '.join(LAYER_TYPES)}")
        return kinds[layer]

    def window(self, layer: int) -> int | None:
        sliding = self.layer_type(layer) == "sliding_attention"
        return self.config.optional_integer("sliding_window") if sliding else None

    def attention_spec(self, layer: int) -> AttentionSpec:
        scalar = self.config.number("query_pre_attn_scalar")
        rope, window = self.rope(self.layer_type(layer)), self.window(layer)
        if self.config.flag("use_bidirectional_attention"):
            # EmbeddingGemma: full layers see every key, sliding layers the keys at most sliding_window // 2 away on
            # either side, ModernBERT's window. Gemma3TextModel's or_mask_function, `_bidirectional_window_overlay`,
            # is abs(q - kv) < w with w = sliding_window // 2 + 1 in memory (Gemma3TextConfig.__post_init__; its
            # to_dict writes config.json's sliding_window back as (w - 1) * 2)
            both: dict[str, Any] = {} if window is None else {"window": window, "window_side": "both"}
            return AttentionSpec(causal=False, rope=rope, scale=scalar ** -0.5, qk_norm=self.qk_norm(), **both)
        return AttentionSpec(causal=True, rope=rope, window=window, scale=scalar ** -0.5, qk_norm=self.qk_norm())

    # --- where head h lives ---------------------------------------------------------------------------------

    def notes(self, layer: int, head: int | None = None) -> list[str]:
        if head is None:
            return super().notes(layer)
        notes = super().notes(layer, head)
        cap = self.config.optional_number("attn_logit_softcapping")
        if cap is not None:
            notes.append(f"config.json sets attn_logit_softcapping {cap:g}, which Gemma 3 does not apply: "
                         "Gemma3Attention passes no softcap to its attention (transformers), and neither does this")
        return notes
