"""NoPE layers, for SmolLM3 and Llama4 (smollm3.py, llama4.py)

NoPE layers: the layers of a model that rotate nothing (no position embedding at all), as SmolLM3 and Llama 4
configure them. Both read the same two keys (`SmolLM3Config.__post_init__`, `Llama4TextConfig.__post_init__`):

- `no_rope_layers`: one 0/1 per layer, and despite its name **1 means the layer uses RoPE** (transformers'
  `self.use_rope = config.no_rope_layers[layer_idx]`);
- else `no_rope_layer_interval` N (default 4): every N-th layer is NoPE, layers N-1, 2N-1, ...
  (`int((layer_idx + 1) % N != 0)`).
An empty list counts as absent in Llama 4 (`self.no_rope_layers if self.no_rope_layers else default`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from attnscope.models.config import Config


def rope_layers(config: Config, n_layer: int) -> list[bool]:
    """Whether each layer rotates Q and K (False: a NoPE layer)."""
    given = config.raw("no_rope_layers")
    if given:
        if (not isinstance(given, list) or len(given) != n_layer
                or not all(not isinstance(v, bool) and v in (0, 1) for v in given)):
            raise UsageError(f"{config.path}: no_rope_layers must be a list of {n_layer} numbers 0 or 1, one per "
                             "layer (1: the layer uses RoPE); fix config.json")
        return [bool(v) for v in given]
    interval = config.integer("no_rope_layer_interval", default=4)
    return [(layer + 1) % interval != 0 for layer in range(n_layer)]


def nope_note(layer: int) -> str:
    return (f"layer {layer} is a NoPE layer: Q and K are not rotated (no cos, sin, Q_rot, K_rot); the scores "
            "carry no position but the causal mask's")
