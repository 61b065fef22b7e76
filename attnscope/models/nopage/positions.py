"""Where a family traced through transformers' attention interface put its positions before handing Q and K over,
in the Q step's words (models/nopage/interface.py's `record`): RoPE only where the model has rotary embeddings and
this layer's module applies them, decided per layer as each family's attention forward decides; else where the
positions went instead (absolute embeddings added before the first layer, a position_bias, or none).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

# families whose positions are absolute embeddings added to the input before the first layer (a vision tower's
# `position_embeddings` on its patches, BERT's and GPT-2's learned positions): no RoPE in Q and K
PATCH_POSITIONS = frozenset({"vit", "deit", "dinov2", "dinov2_with_registers", "clip_vision_model",
                             "siglip_vision_model"})
TOKEN_POSITIONS = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "electra", "gpt2", "opt",
                             "clip_text_model", "siglip_text_model"})


# Families that turn Q and K on some layers only, each decided as its attention's forward decides (the `if` before
# its `apply_rotary_pos_emb`), keyed by the attention module's class: whether this layer's module turns them, and
# which layers do
def _sliding_only(module: Any) -> bool:  # Cohere2Attention.forward: `if self.sliding_window is not None:`
    return module.sliding_window is not None


def _global_nope(module: Any) -> bool:  # Exaone4Attention.forward: `if self.sliding_window is None or self.is_sliding:`
    return module.sliding_window is None or module.is_sliding


SLIDING = "the family turns Q and K on its sliding-window layers only"
LAYER_ROPE: dict[str, tuple[Callable[[Any], bool], str]] = {
    "Cohere2Attention": (_sliding_only, SLIDING),  # Cohere2 Vision's text too
    "FlintAttention": (_sliding_only, SLIDING),
    # Cohere2MoeAttention.forward: `if self.sliding_window is not None or self.force_rope:` (force_rope: a dense
    # prefix layer, where prefix_dense_sliding_window_pattern is 1)
    "Cohere2MoeAttention": (lambda m: m.sliding_window is not None or m.force_rope,
                            "the family turns Q and K on its sliding-window layers (and force_rope's) only"),
    # "We use global NoPE for hybrid attention model": EXAONE 4's, 4.5's and MoE's, Kolibri1's
    "Exaone4Attention": (_global_nope, SLIDING),
    "Exaone4_5_Attention": (_global_nope, SLIDING),  # its text model's attention
    "ExaoneMoeAttention": (_global_nope, SLIDING),
    "Kolibri1Attention": (_global_nope, SLIDING),
    "AfmoeAttention": (lambda m: m.is_local_attention, SLIDING),  # AfmoeAttention: `if self.is_local_attention:`
    # the model builds its rotary embedding only where the config asks, and hands the layers None otherwise:
    # GraniteMoeHybridModel.__init__ (Granite 4.0-H: position_embedding_type None) and OlmoHybridModel.__init__
    # ("Released ckpt don't use any ROPE": no rope_parameters' rope_theta)
    "GraniteMoeHybridAttention": (lambda m: m.config.position_embedding_type == "rope",
                                  "the config's position_embedding_type is not 'rope'"),
    "OlmoHybridAttention": (lambda m: (m.config.rope_parameters or {}).get("rope_theta") is not None,
                            "the config's rope_parameters have no rope_theta"),
}


def _layer_rope(module: Any, config: Any) -> tuple[bool, str]:
    """Whether this layer's module turns Q and K, where its family's model has rotary embeddings, and if not why:
    by its family's rule (LAYER_ROPE); a module's `use_rope` (Llama 4's, SmolLM3's, Mistral Large 4's
    `if self.use_rope:`); a config's `layer_rope_theta` of 0 for the layer (Granite SWA's and Muse's: the model
    hands that layer `position_embeddings=None`, GraniteSWAModel.forward)."""
    rule = LAYER_ROPE.get(type(module).__name__)
    if rule is not None:
        try:
            return rule[0](module), rule[1]
        except AttributeError:  # another transformers' version of the class, without the attribute its rule reads
            pass
    if getattr(module, "use_rope", True) is False:
        return False, ""
    thetas, index = getattr(config, "layer_rope_theta", None), getattr(module, "layer_idx", None)
    if isinstance(thetas, (list, tuple)) and isinstance(index, int) and index < len(thetas) and not thetas[index]:
        return False, f"the config's layer_rope_theta[{index}] is 0"
    return True, ""


def rotated(module: Any) -> bool:
    """Whether the family rotated Q and K (RoPE) before handing them over: where the model has rotary embeddings
    (a config's rope_parameters, rope_theta or rotary_dim; rotary code in its modeling file) and this layer applies
    them (`_layer_rope`)."""
    config = getattr(module, "config", None)
    return _rotary(module, config) and _layer_rope(module, config)[0]


def _rotary(module: Any, config: Any) -> bool:
    """The model has rotary embeddings: a config's rope_parameters, rope_theta or rotary_dim, or rotary code in its
    modeling file."""
    rotary = any(getattr(config, key, None) is not None for key in ("rope_parameters", "rope_theta", "rotary_dim"))
    return rotary or any("rotary" in name.lower() for name in vars(sys.modules[type(module).__module__]))


def before(module: Any, extras: dict[str, Any]) -> str:
    """What the family did to Q and K before handing them over, in the Q step's words: RoPE only where the model
    has rotary embeddings and this layer applies them (`rotated`); else where its positions went instead."""
    config = getattr(module, "config", None)
    rotary = _rotary(module, config)
    turned, why = _layer_rope(module, config) if rotary else (False, "")
    if turned:
        return "(its projections, norms and RoPE before: not traced)"
    done = "(its projections and norms before: not traced)"
    kind = getattr(config, "model_type", "")
    if rotary:
        return f"{done}; no RoPE in this layer" + (f" (NoPE: {why})" if why else "")
    if extras.get("position_bias") is not None:
        return f"{done}; no RoPE: positions enter as position_bias, below"
    if kind in PATCH_POSITIONS | TOKEN_POSITIONS:
        embeddings = "patch" if kind in PATCH_POSITIONS else "token"
        return f"{done}; no RoPE: positions are absolute embeddings added to the {embeddings} embeddings before " \
               "the first layer"
    return f"{done}; no RoPE"
