"""An independent RoPE reference for `--check`: transformers reads the config and computes the frequencies, and
the rotation is done here in float64. It shares no code with rope.py, rope_scaling.py or rope_config.py.

- The config: transformers' own config class for its `model_type` (`AutoConfig.for_model`, "llama" when it
  names none) reads the dict, so both saved forms (5.x `rope_parameters`, 4.4x `rope_theta` + `rope_scaling`,
  Gemma 3's `rope_local_base_freq`, GPT-NeoX's `rotary_pct`) are read by transformers, not by attnscope.
- The frequencies: `ROPE_INIT_FUNCTIONS[rope_type]` for every scaled type, with the length rule transformers'
  `dynamic_rope_update` applies (dynamic: recomputed for a forward beyond max_position_embeddings, with the
  length as a tensor; longrope: the long factors beyond original_max_position_embeddings); the default type is
  `rope_theta^(-2i/dim)` in float64, dim = int(partial_rotary_factor · head_dim). GPT-J and CodeGen (no
  rope_parameters): 10000^(-2i/rotary_dim).
- The rotation, in float64: interleaved pairs (2i, 2i + 1) as complex numbers (`view_as_complex`, Llama 4's
  way) times e^{i·p·θ}; half-split pairs (i, i + dim/2) as explicit halves `(a cos − b sin, b cos + a sin)`; the
  coordinates past the rotated ones pass unchanged; everything times the attention scaling (yarn, longrope).

Use: `rotate64(x, config, start=p0, seq_len=n_pos, pairing=...)`, x `[.., n, d_head]` at positions
p0 .. p0 + n − 1 of a forward over positions 0 .. seq_len − 1 (default: p0 + n). `config` is a config.json dict;
a run without a model can pass `{"rope_parameters": {...}, "head_dim": d, "max_position_embeddings": m}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


def transformers_config(config: Mapping[str, Any]) -> Any:
    """transformers' config object for a config.json dict, its warnings silenced."""
    import transformers
    from transformers import AutoConfig

    fields = dict(config)
    model_type = fields.pop("model_type", None) or "llama"
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        made = AutoConfig.for_model(model_type, **fields)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return getattr(made, "text_config", None) if model_type in ("gemma3", "llama4") else made


def frequencies64(config: Mapping[str, Any], seq_len: int, layer_type: str | None = None,
                  head_dim: int | None = None) -> tuple[Tensor, float]:
    """`inv_freq` (float64) and the attention scaling of a rotary module's forward over positions
    0 .. seq_len − 1, as transformers computes them."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if config.get("model_type") in ("gptj", "codegen"):  # GPTJAttention: `rotary_dim or embed_dim`, base 10000
        dim = config.get("rotary_dim", 64) or head_dim or config["n_embd"] // config["n_head"]
        return 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0
    made = transformers_config(config)
    if head_dim is not None:
        made.head_dim = head_dim
    size = getattr(made, "head_dim", None) or made.hidden_size // made.num_attention_heads
    parameters = made.rope_parameters if layer_type is None else made.rope_parameters[layer_type]
    rope_type = parameters["rope_type"]
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "default":
        dim = int(size * parameters.get("partial_rotary_factor", 1.0))
        base = float(parameters["rope_theta"])
        return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0
    initial = ROPE_INIT_FUNCTIONS[rope_type]
    if rope_type == "dynamic" and seq_len > made.max_position_embeddings:
        inv_freq, scaling = initial(made, None, seq_len=torch.tensor(seq_len), **kwargs)
    elif rope_type == "longrope":
        inv_freq, scaling = initial(made, None, **kwargs)  # the attention scaling stays the initial one
        if seq_len > parameters["original_max_position_embeddings"]:
            inv_freq = initial(made, None, seq_len=parameters["original_max_position_embeddings"] + 1, **kwargs)[0]
    else:
        inv_freq, scaling = initial(made, None, **kwargs)
    return inv_freq.double(), float(scaling)


def rotate64(x: Tensor, config: Mapping[str, Any], *, start: int = 0, seq_len: int | None = None,
             layer_type: str | None = None, head_dim: int | None = None, pairing: str = "half-split") -> Tensor:
    """x `[.., n, d_head]` rotated in float64 at positions start .. start + n − 1."""
    import torch

    n = x.shape[-2]
    inv_freq, scaling = frequencies64(config, start + n if seq_len is None else seq_len, layer_type,
                                      head_dim or x.shape[-1])
    angle = torch.arange(start, start + n, dtype=torch.float64)[:, None] * inv_freq  # [n, pairs]
    turn = torch.polar(torch.full_like(angle, scaling), angle)  # scaling · e^{i·p·θ}
    width = 2 * inv_freq.shape[0]
    x = x.double()
    x_rot, x_pass = x[..., :width], x[..., width:]
    if pairing == "interleaved":
        # [.., n, width/2] complex
        z = torch.view_as_complex(x_rot.reshape(*x_rot.shape[:-1], width // 2, 2).contiguous()) * turn
        rotated = torch.view_as_real(z).flatten(-2)
    else:
        a, b = x_rot[..., : width // 2], x_rot[..., width // 2 :]
        rotated = torch.cat([a * turn.real - b * turn.imag, b * turn.real + a * turn.imag], dim=-1)
    return torch.cat([rotated, x_pass], dim=-1)
