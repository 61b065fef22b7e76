"""What the families' blocks share, in plain torch: norms, activations, the two kinds of MLP.

Each function is the formula transformers' eager module computes (named beside it), in float32: the
forward upcasts every weight it reads, so these never need a dtype dance. torch is imported inside the
functions: the family modules import this one, and a weight dump must not pay for torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from torch import Tensor


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """`nn.LayerNorm` (BERT, RoBERTa, GPT-2; ModernBERT's has no bias)."""
    import torch.nn.functional as F

    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, plus_one: bool = False) -> Tensor:
    """`LlamaRMSNorm`: `x / sqrt(mean(x²) + eps) * w`. Gemma's `Gemma2RMSNorm` scales by `(1 + w)` instead:
    its weights are stored as offsets from 1 (`plus_one=True`)."""
    import torch

    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [.., d_model]
    return normed * (1.0 + weight if plus_one else weight)


def _gelu_tanh(x: Tensor) -> Tensor:
    """`NewGELUActivation`: GELU's tanh approximation, as GPT-2 computes it."""
    import torch

    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# transformers' ACT2FN names for the activations these families use.
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "silu", "swish", "relu")


def activation(name: object, where: str) -> Callable[[Tensor], Tensor]:
    import torch.nn.functional as F

    table: dict[str, Callable[[Tensor], Tensor]] = {
        "gelu": F.gelu,  # exact, erf-based (BERT, RoBERTa)
        "gelu_new": _gelu_tanh,  # GPT-2
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # Gemma 2
        "gelu_fast": _gelu_tanh,
        "silu": F.silu,  # LLaMA, Mistral, Qwen2 (SwiGLU's gate)
        "swish": F.silu,
        "relu": F.relu,
    }
    if not isinstance(name, str) or name not in table:
        raise UsageError(f"{where}: activation {name!r} is not one attnscope computes ({', '.join(ACTIVATIONS)})")
    return table[name]


def gated_mlp(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, act: Callable[[Tensor], Tensor],
              biases: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None)) -> Tensor:
    """`LlamaMLP`: `down(act(gate(x)) * up(x))`, d_model -> d_ff -> d_model."""
    import torch.nn.functional as F

    hidden = act(F.linear(x, gate, biases[0])) * F.linear(x, up, biases[1])  # [.., d_ff]
    return F.linear(hidden, down, biases[2])  # [.., d_model]


def plain_mlp(x: Tensor, fc: Tensor, fc_bias: Tensor | None, proj: Tensor, proj_bias: Tensor | None,
              act: Callable[[Tensor], Tensor]) -> Tensor:
    """BERT's intermediate + output dense, GPT-2's c_fc + c_proj: `proj(act(fc(x)))`."""
    import torch.nn.functional as F

    return F.linear(act(F.linear(x, fc, fc_bias)), proj, proj_bias)  # [.., d_model]
