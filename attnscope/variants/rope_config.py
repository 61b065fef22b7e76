"""RoPE as a config.json says it, in both forms transformers saves, read the way transformers' config classes
read them (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` and `standardize_rope_params`, and the
families' own overrides named below).

- transformers 5.x: `rope_parameters`, one dict (`rope_type`, `rope_theta`, `factor`, ...,
  `partial_rotary_factor`), or one dict per layer type (Gemma 3: `full_attention` with base 1M and
  `sliding_attention` with 10k; a type given null has no RoPE).
- transformers 4.4x: `rope_theta` + `rope_scaling` (its `type` or `rope_type`), `partial_rotary_factor` (Phi-3,
  StableLM, Persimmon, Phi) or GPT-NeoX's `rotary_pct` and `rotary_emb_base`; Gemma 3's `rope_local_base_freq`
  for its sliding layers (`rope_scaling` then applies to the full ones only); ModernBERT's
  `global_rope_theta`/`local_rope_theta` (`rope_scaling` applies to both); GPT-J's and CodeGen's `rotary_dim`
  (a count of coordinates, base fixed at 10000).
Where both `rope_scaling` and `rope_parameters` are present, `rope_scaling` wins, as in transformers. A config
without `rope_theta` anywhere gets its class's `default_theta`: 10000 but for the families in DEFAULT_THETA (Gemma 3:
1M and 10k; ModernBERT 160k and 10k); one with neither dict gets what its class builds (GPT-OSS: yarn).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from attnscope.errors import UsageError
from attnscope.variants.rope_scaling import whole

# Families that pair coordinates 2i and 2i + 1: `rotate_every_two` (GPT-J, CodeGen), a complex product of
# consecutive pairs (Llama 4, DeepSeek-V2), a `rotate_half` over `x[..., 0::2]` and `x[..., 1::2]` (Cohere,
# GLM, Helium, ERNIE 4.5). Every other family is half-split.
INTERLEAVED = frozenset({"gptj", "codegen", "llama4", "llama4_text", "deepseek_v2", "cohere", "cohere2", "glm",
                         "glm4", "helium", "ernie4_5", "ernie4_5_moe"})
# `partial_rotary_factor` when the config does not say (the classes' own defaults, for backward compatibility).
PARTIAL = {"gpt_neox": 0.25, "stablelm": 0.25, "persimmon": 0.5, "phi": 0.5, "glm": 0.5, "glm4": 0.5, "glm4_moe": 0.5,
           "nemotron": 0.5, "recurrent_gemma": 0.5, "qwen3_next": 0.25, "qwen3_5_text": 0.25,
           "qwen3_5_moe_text": 0.25}
# Per-layer-type bases in 4.4x configs: (full key, sliding key, full default, sliding default, scaling on both).
LOCAL_GLOBAL = {"gemma3_text": ("rope_theta", "rope_local_base_freq", 1_000_000.0, 10_000.0, False),
                "gemma3": ("rope_theta", "rope_local_base_freq", 1_000_000.0, 10_000.0, False),
                "modernbert": ("global_rope_theta", "local_rope_theta", 160_000.0, 10_000.0, True)}
# `default_theta` where a page's config class declares another than 10000, and the scaling a class builds where
# config.json gives neither rope_parameters nor rope_scaling (GptOssConfig.__post_init__): a config without them
# is read as transformers reads it (issue 43's campaign: --check had FAILed by 0.14 on GPT-OSS, 0.04 on Llama 4).
DEFAULT_THETA = {"gpt_oss": 150_000.0, "llama4": 500_000.0, "llama4_text": 500_000.0, "minimax": 1_000_000.0,
                 "smollm3": 2_000_000.0}
CLASS_SCALING = {"gpt_oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 4096}}
# Phi3Config always has `original_max_position_embeddings` (4096 by default), and it overrides the one in the
# scaling dict (`standardize_rope_params`); older Phi-3 configs call longrope "su" or "yarn".
PHI3 = frozenset({"phi3", "phi4_multimodal"})
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_dim", "rotary_pct", "partial_rotary_factor")


def rope_arguments(config: Mapping[str, Any], layer_type: str | None = None,
                   size: int | None = None) -> dict[str, Any] | None:
    """`Rope(**arguments)` for the layers of `layer_type`; None where that type has no RoPE (a NoPE layer).
    `size`: the head size, where the caller knows it better than the config (GPT-J's rotary_dim needs it)."""
    if not isinstance(config, Mapping):
        raise UsageError(f"the config is {type(config).__name__}; it must be a dict, as config.json holds")
    text = config.get("text_config")
    if isinstance(text, Mapping) and not any(key in config for key in ROPE_KEYS):
        config = text  # Gemma 3's and Llama 4's multimodal configs keep the language model's in text_config
    model_type = str(config.get("model_type") or "")
    pairing = "interleaved" if model_type in INTERLEAVED else "half-split"
    max_positions = config.get("max_position_embeddings", config.get("n_positions"))
    common = {"pairing": pairing, "max_position_embeddings": max_positions}
    if model_type in ("gptj", "codegen"):
        return common | {"base": 10000.0, "partial_rotary_factor": _rotary_dim_fraction(config, size)}
    scaling, parameters = _mapping(config, "rope_scaling"), _mapping(config, "rope_parameters")
    layer_types = config.get("layer_types")
    layer_types = layer_types if isinstance(layer_types, list) else []
    nested = parameters is not None and any(isinstance(v, Mapping) or k in layer_types for k, v in parameters.items())
    if model_type in LOCAL_GLOBAL:
        by_type: Mapping[str, Any] = _local_global(config, model_type, scaling, parameters or {})
    elif nested and not scaling:
        by_type = parameters  # type: ignore[assignment]
    else:
        # A class's own default (GptOssConfig's yarn) stands only where rope_parameters is missing or null: an
        # empty dict is kept and means the default RoPE, as `GptOssConfig.__post_init__` then
        # `convert_rope_params_to_dict` (`rope_scaling or rope_parameters`) read it.
        own = parameters if parameters is not None else CLASS_SCALING.get(model_type, {})
        return common | _flat(config, model_type, dict(scaling or own),
                              "rope_scaling" if scaling else "rope_parameters")
    if layer_type is None:
        raise UsageError(f"rope_parameters gives each layer type its own RoPE ({', '.join(by_type)}); "
                         "say which with layer_type")
    if layer_type not in by_type:
        raise UsageError(f"rope_parameters has no layer type {layer_type!r}; it has {', '.join(by_type)}")
    entry = by_type[layer_type]
    if entry is None:
        return None
    source = f"rope_parameters.{layer_type}"
    if not isinstance(entry, Mapping):
        raise UsageError(f"{source} is {entry!r}; it must be a dict such as {{'rope_type': 'default', "
                         "'rope_theta': 10000.0}")
    entry = dict(entry)
    entry.setdefault("rope_theta", config.get("rope_theta", DEFAULT_THETA.get(model_type, 10000.0)))
    if config.get("partial_rotary_factor") is not None:
        entry.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    # `_compute_yarn_parameters` reads `truncate` from the top of rope_parameters, which per layer type holds
    # only the types: a nested yarn always truncates in transformers.
    entry["truncate"] = True
    return common | {"base": entry["rope_theta"], "scaling": entry, "source": source}


def _flat(config: Mapping[str, Any], model_type: Any, parameters: dict[str, Any], source: str) -> dict[str, Any]:
    if model_type == "gpt_neox":  # GPTNeoXConfig reads only its own names
        theta, partial = config.get("rotary_emb_base", 10000.0), config.get("rotary_pct", 0.25)
    else:
        theta = config.get("rope_theta", DEFAULT_THETA.get(model_type, 10000.0))
        partial = config.get("partial_rotary_factor", PARTIAL.get(model_type))
    parameters.setdefault("rope_theta", theta)
    if partial is not None:
        parameters.setdefault("partial_rotary_factor", partial)
    if model_type in PHI3:
        if parameters.get("rope_type", parameters.get("type")) in ("su", "yarn"):
            parameters["rope_type"] = "longrope"
        if parameters.get("rope_type", parameters.get("type")) in ("llama3", "yarn", "longrope"):
            parameters["original_max_position_embeddings"] = config.get("original_max_position_embeddings", 4096)
    return {"base": parameters["rope_theta"], "scaling": parameters, "source": source}


def _local_global(config: Mapping[str, Any], model_type: str, scaling: Mapping[str, Any] | None,
                  parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's and ModernBERT's `convert_rope_params_to_dict`: full and sliding layers, each its own dict."""
    full_key, local_key, full_base, local_base, scaling_on_both = LOCAL_GLOBAL[model_type]
    by_type = {kind: dict(parameters.get(kind) or {"rope_type": "default"})
               for kind in ("full_attention", "sliding_attention")}
    for kind in ("full_attention", "sliding_attention") if scaling_on_both else ("full_attention",):
        by_type[kind].update(scaling or {})
    by_type["full_attention"].setdefault("rope_theta", config.get(full_key, full_base))
    by_type["sliding_attention"].setdefault("rope_theta", config.get(local_key, local_base))
    return by_type


def _mapping(config: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    value = config.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise UsageError(f"{key} is {value!r}; it must be a dict such as {{'rope_type': 'linear', 'factor': 2.0}}")
    return value


def _rotary_dim_fraction(config: Mapping[str, Any], size: int | None) -> float | None:
    """GPT-J's `rotary_dim` (64 by default; null: the whole head) as the fraction whose `int(f · head_dim)`
    gives it back exactly."""
    if "rotary_dim" in config and config["rotary_dim"] is None:
        return None
    rotary_dim, size = whole(config.get("rotary_dim", 64), "rotary_dim"), size or head_dim(config)
    if size is None:
        raise UsageError("the config has no n_embd and n_head to size rotary_dim against; give head_dim")
    if rotary_dim > size:
        raise UsageError(f"rotary_dim {rotary_dim} is more than the head's {size} coordinates")
    fraction = rotary_dim / size
    while int(size * fraction) < rotary_dim:
        fraction = math.nextafter(fraction, 2.0)
    return fraction


def head_dim(config: Mapping[str, Any]) -> int | None:
    """The config's `head_dim`, else hidden_size / num_attention_heads (GPT-J: n_embd / n_head), else None."""
    if config.get("head_dim") is not None:
        return whole(config["head_dim"], "head_dim")
    for width, heads in (("hidden_size", "num_attention_heads"), ("n_embd", "n_head")):
        if config.get(width) is not None and config.get(heads) is not None:
            return whole(config[width], width) // whole(config[heads], heads)
    return None
