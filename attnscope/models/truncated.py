"""A model attnscope has no page for, through transformers, with only layers 0..L built and loaded.

The config is read by `AutoConfig` (trust_remote_code off: no code from the model's folder runs) and cut to
L + 1 layers (`num_hidden_layers`, and every per-layer list, `layer_types` and the like), so `from_pretrained`
builds L + 1 layers and reads only their tensors from the checkpoint (the others are skipped as unexpected),
plus the embeddings and final norm. Then:

- a family whose modules call transformers' attention interface (`_supports_attention_backend`) runs with
  attnscope's implementation (models/interface.py), which records layer L's attention and stops the forward
  there: `traced`;
- any other family runs its eager attention with `output_attentions` through its L + 1 layers: the pattern
  only.

Everything is float32 on the CPU, batch 1, no padding.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnscope.errors import ResourceError, UsageError

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.models.checkpoint import Checkpoint
    from attnscope.models.interface import Recorded

_LAYER = re.compile(r"\.(\d+)\.")


@dataclass
class TransformersRun:
    """Layer L through transformers: the recorded steps (None where the family does not call the interface),
    every head's pattern `[n_head, n_tokens, n_tokens]`, and the model's sizes as its config says."""

    recorded: Recorded | None
    attention: torch.Tensor
    architecture: str
    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    d_head: int
    module: str  # the attention module's class, `GPTNeoXAttention`


def estimate_bytes(checkpoint: Checkpoint, layer: int, n_tokens: int) -> int:
    """Layers 0..L's tensors and every tensor outside the layers (embeddings, norms), in float32, once held and
    once being loaded, plus activations of every head's scores: what the truncated load needs."""
    numel = 0
    for key in checkpoint.keys:
        found = _LAYER.search(key)
        if found is None or int(found.group(1)) <= layer:
            numel += math.prod(checkpoint.shape(key))
    return 2 * 4 * numel + 4 * 64 * n_tokens * n_tokens + 4 * 1024 * n_tokens * 64


def load_config(folder: Path, model_type: str, layer: int) -> tuple[Any, int]:
    """The config cut to layers 0..`layer`, and the number of layers the model has."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        raise UsageError(f"{{model}} {folder}: transformers cannot read model_type '{model_type}' ({_first(exc)})",
                         "model") from None
    n_layer = getattr(config, "num_hidden_layers", None)
    if not isinstance(n_layer, int) or n_layer < 1:
        raise UsageError(f"{{model}} {folder}: config.json gives model_type '{model_type}' no num_hidden_layers; "
                         "attnscope cannot tell its layers apart", "model")
    if not 0 <= layer < n_layer:
        raise UsageError(f"{{layer}} {layer} is out of range: this model has {n_layer} layers, 0 to {n_layer - 1}",
                         "layer")
    for name, value in config.to_dict().items():  # layer_types, no_rope_layers, ...: one entry per layer
        if isinstance(value, list) and len(value) == n_layer and hasattr(config, name):
            setattr(config, name, value[: layer + 1])
    config.num_hidden_layers = layer + 1
    return config, n_layer


def run(folder: Path, ids: list[int], model_type: str, layer: int) -> TransformersRun:
    import torch
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    from attnscope.models import interface

    hf_logging.set_verbosity_error()  # its load report (the layers left out are "unexpected") would bury the table
    hf_logging.disable_progress_bar()
    config, n_layer = load_config(folder, model_type, layer)
    traced = _routes_through_interface(config)
    implementation = interface.IMPLEMENTATION if traced else "eager"
    if traced:
        interface.register()
    try:
        model = AutoModel.from_pretrained(str(folder), config=config, attn_implementation=implementation,
                                          dtype=torch.float32, trust_remote_code=False).eval()
    except (OSError, ValueError, KeyError, TypeError, ImportError, RuntimeError) as exc:
        raise UsageError(f"{{model}} {folder}: transformers cannot load model_type '{model_type}' either "
                         f"({_first(exc)})", "model") from None
    recorded = None
    inputs = torch.tensor([ids])
    try:
        with torch.no_grad():
            if traced:
                with interface.recording(layer) as recorder:
                    try:
                        model(input_ids=inputs)
                    except interface.Reached:
                        pass
                recorded = recorder.recorded
            if recorded is None:  # a layer that does not call the interface: its eager pattern
                model.set_attn_implementation("eager")
                out = model(input_ids=inputs, output_attentions=True)
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
        raise ResourceError(f"transformers could not run model_type '{model_type}' on the text alone "
                            f"({_first(exc)})") from None
    if recorded is not None:
        attention = recorded.layer["attention"][0]
    else:
        attentions = getattr(out, "attentions", None)
        if not attentions or attentions[-1] is None:
            raise ResourceError(f"model_type '{model_type}' gives no attention weights (output_attentions) in "
                                "transformers; attnscope cannot show its pattern")
        attention = attentions[layer][0]
    return _sizes(model, recorded, attention, n_layer, layer)


def _routes_through_interface(config: Any) -> bool:
    """Whether the model class transformers builds for this config calls the attention interface."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        cls = MODEL_MAPPING[type(config)]
    except KeyError:
        return False
    return bool(getattr(cls, "_supports_attention_backend", False))


def _sizes(model: Any, recorded: Recorded | None, attention: torch.Tensor, n_layer: int,
           layer: int) -> TransformersRun:
    config = model.config
    n_head = int(attention.shape[0])
    d_model = int(getattr(config, "hidden_size", 0) or 0)
    if recorded is not None:
        d_head, n_kv_head = int(recorded.layer["Q"].shape[-1]), recorded.n_kv_head
    else:
        d_head = int(getattr(config, "head_dim", 0) or (d_model // n_head if n_head else 0))
        n_kv_head = int(getattr(config, "num_key_value_heads", n_head) or n_head)
    module = _attention_module(model, layer)
    return TransformersRun(recorded, attention, type(model).__name__, n_layer, n_head, n_kv_head, d_model, d_head,
                           module)


def _attention_module(model: Any, layer: int) -> str:
    """The class name of layer `layer`'s attention module (`GPTNeoXAttention`), or "" if none is found."""
    for name, module in model.named_modules():
        found = _LAYER.search(f"{name}.")
        if found and int(found.group(1)) == layer and type(module).__name__.endswith("Attention"):
            return type(module).__name__
    return ""


def _first(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else type(exc).__name__
