"""What `--check` compares with: the reference, built again from the raw inputs and the user's own words
(`Asked`: the attention's spec and the padded keys), never from a tensor attnscope produced, and never with
attnscope's attention, mask or position code.

- Masks: the file's mask read as the documented rule says (boolean; integers `!= 0`; floats added),
  padding as a boolean row, causal through `is_causal=True` or
  `torch.nn.attention.bias.causal_lower_right` when it is the only mask, else `torch.ones(...).tril(...)`,
  a sliding window as the difference of two `tril`s, all combined by boolean AND.
- Where PyTorch has no kernel for what was asked (softcapping, RoPE, ALiBi, qk-norm) the reference is the
  formula in float64: qk-norm through PyTorch's `F.rms_norm` before RoPE, RoPE as the rotation of complex
  numbers `x_i + i·x_{i+d/2}` by `e^{i·p·θ_i}`, ALiBi from BLOOM's `build_alibi_tensor` (transformers), softcap
  `C·tanh(s / C)`, and PyTorch's `_safe_softmax` rule (a query that may see no key gets zeros).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    from attnscope.qknorm import QkNorm

FORMULA = "float64 formula"


@dataclass(frozen=True)
class Asked:
    """The attention as the user asked for it (its `AttentionSpec`, in the user's words) and the padded keys:
    the reference is built from these and the raw inputs alone."""

    spec: AttentionSpec = AttentionSpec()
    pad: int = 0

    @property
    def causal(self) -> str | None:  # "upper-left", "lower-right"
        return self.spec.align

    @property
    def window(self) -> int | None:
        return self.spec.window

    @property
    def scale(self) -> float | None:
        return self.spec.scale

    @property
    def softcap(self) -> float | None:
        return self.spec.softcap

    @property
    def alibi(self) -> bool:
        return self.spec.alibi

    @property
    def rope_base(self) -> float | None:
        return None if self.spec.rope is None else self.spec.rope.base

    @property
    def qk_norm(self) -> QkNorm | None:
        return self.spec.norm

    @property
    def needs_formula(self) -> bool:
        return self.softcap is not None or self.alibi or self.rope_base is not None or self.qk_norm is not None


# --- the reference mask, from the user's words ----------------------------------------------------------


def user_parts(user: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """The file's mask as the rule reads it: (boolean part, additive part)."""
    if user is None:
        return None, None
    if user.dtype == torch.bool:
        return user, None
    if user.is_floating_point():
        return None, user
    return user != 0, None  # integer 0/1 (the run refused any other integer)


def allowed_mask(user: Tensor | None, n_Q: int, n_K: int, asked: Asked) -> Tensor | None:
    """Everything boolean, ANDed: the file's mask, padding, causal and window, as `[.., n_Q, n_K]`."""
    parts = []
    if user is not None:
        parts.append(user)
    if asked.pad:
        keep = torch.ones(n_K, dtype=torch.bool)
        keep[n_K - asked.pad :] = False
        parts.append(keep)
    offset = n_K - n_Q if asked.causal == "lower-right" else 0
    ones = torch.ones(n_Q, n_K, dtype=torch.bool)
    if asked.window is not None:
        parts.append(ones.tril(diagonal=offset) & ~ones.tril(diagonal=offset - asked.window))
    elif asked.causal:
        parts.append(ones.tril(diagonal=offset))
    if not parts:
        return None
    allowed = parts[0]
    for part in parts[1:]:
        allowed = allowed & part
    return allowed if allowed.dim() >= 2 else allowed.expand(n_Q, n_K)  # F.sdpa takes no 1-D mask


def sdpa_mask(user: Tensor | None, n_Q: int, n_K: int, asked: Asked,
               dtype: torch.dtype = torch.float32) -> tuple[object | None, bool]:
    """`attn_mask` and `is_causal` for F.scaled_dot_product_attention, built with PyTorch's own functions; a
    float mask takes the queries' `dtype`, as F.scaled_dot_product_attention requires."""
    boolean, additive = user_parts(user)
    additive = additive.to(dtype) if additive is not None else None
    alone = boolean is None and additive is None and not asked.pad and asked.window is None
    if alone and asked.causal == "upper-left":
        return None, True
    if alone and asked.causal == "lower-right" and n_Q <= n_K:  # it gives NaN for queries that see no key
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(n_Q, n_K), False
    allowed = allowed_mask(boolean, n_Q, n_K, asked)
    if additive is None:
        return allowed, False
    if allowed is None:
        return additive if additive.dim() >= 2 else additive.expand(n_Q, n_K), False
    return torch.where(allowed, additive, -math.inf), False


# --- the float64 formula ------------------------------------------------------------------------------------


def _rope_complex(x: Tensor, base: float, start: int) -> Tensor:
    """Half-split RoPE as complex rotation, in float64: x_i + i·x_{i+d/2} turned by e^{i·p·θ_i}."""
    d, n = x.shape[-1], x.shape[-2]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    angle = torch.arange(start, start + n, dtype=torch.float64)[:, None] * theta  # [n, d/2]
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


def rms_norm64(x: Tensor, weight: Tensor | None, eps: float, offset: bool = False) -> Tensor:
    """qk-norm's RMSNorm over the last axis in float64, by PyTorch's `F.rms_norm`; Gemma's weights are offsets
    from 1."""
    import torch.nn.functional as F

    w = None if weight is None else (1.0 + weight.double() if offset else weight.double())
    return F.rms_norm(x.double(), (x.shape[-1],), w, eps)


def formula(q: Tensor, k: Tensor, v: Tensor, user: Tensor | None, asked: Asked, *,
             q_start: int | None = None, k_start: int = 0, rotated_keys: int = 0) -> tuple[Tensor, Tensor]:
    """out, attention in float64. Heads on axis -3 (K/V may have fewer, shared by groups of query heads).
    `rotated_keys` leading keys are taken as already rotated (and normed: a KV cache). A qk-norm here is sdpa's,
    of unit weight over d_K; a module's weighted one is applied by its caller before."""
    q, k, v = q.double(), k.double(), v.double()
    n_Q, n_K, d = q.shape[-2], k.shape[-2], q.shape[-1]
    offset = n_K - n_Q if asked.causal == "lower-right" else 0
    if asked.qk_norm is not None:
        q = rms_norm64(q, None, asked.qk_norm.eps)
        k = torch.cat([k[..., :rotated_keys, :], rms_norm64(k[..., rotated_keys:, :], None, asked.qk_norm.eps)], dim=-2)
    if asked.rope_base is not None:
        q = _rope_complex(q, asked.rope_base, offset if q_start is None else q_start)
        fresh = _rope_complex(k[..., rotated_keys:, :], asked.rope_base, k_start + rotated_keys)
        k = torch.cat([k[..., :rotated_keys, :], fresh], dim=-2)
    if q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        serving = torch.arange(q.shape[-3]) // (q.shape[-3] // k.shape[-3])  # the KV head of each query head
        k, v = k.index_select(-3, serving), v.index_select(-3, serving)
    scale = 1 / math.sqrt(d) if asked.scale is None else asked.scale
    s = torch.einsum("...qd,...kd->...qk", q, k) * scale
    if asked.softcap is not None:
        s = asked.softcap * torch.tanh(s / asked.softcap)
    if asked.alibi:
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        n_head = q.shape[-3] if q.dim() >= 4 else 1
        bloom = build_alibi_tensor(torch.ones(1, n_K), n_head, torch.float64)  # [n_head, 1, n_K]: slope * j
        s = s + (bloom if q.dim() >= 4 else bloom[0])
    boolean, additive = user_parts(user)
    if additive is not None:
        s = s + additive.double()
    allowed = allowed_mask(boolean, n_Q, n_K, asked)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, dim=-1)
    p = torch.where(torch.isneginf(s).all(dim=-1, keepdim=True), 0.0, p)  # PyTorch's _safe_softmax rule
    return torch.einsum("...qk,...kd->...qd", p, v), p
