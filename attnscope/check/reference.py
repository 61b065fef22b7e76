"""What `--check` compares with: the reference, built again from the raw inputs and the user's own words
(`Asked`: the attention's spec and the padded keys), never from a tensor attnscope produced, and never with
attnscope's attention, mask or position code.

- Masks: the file's mask read as the documented rule says (boolean; integers `!= 0`; floats added),
  padding as a boolean row, causal through `is_causal=True` when it is the only mask, else
  `torch.ones(...).tril(diagonal=n_K - n_Q)` for lower-right (what `torch.nn.attention.bias.causal_lower_right`
  materializes, tests/test_check.py; importing that module imports torch's compiler, seconds of start-up and
  a $TMPDIR/torchinductor_* folder), a sliding window as the difference of two `tril`s (a bidirectional one as a
  `tril` and a `triu`), chunks as a block-diagonal of ones (`torch.block_diag`) over the positions, all combined
  by boolean AND.
- Where PyTorch has no kernel for what was asked (softcapping, RoPE, ALiBi, temperature tuning, sinks, qk-norm,
  a position bias) the reference is the formula in float64: qk-norm through PyTorch's `F.rms_norm` before RoPE,
  RoPE from check_rope.py's `rotate64` (transformers' config classes and `ROPE_INIT_FUNCTIONS` for the
  frequencies, every type, partial rotary and either pairing), ALiBi from BLOOM's `build_alibi_tensor`
  (transformers), softcap `C·tanh(s / C)`, Llama 4's temperature `1 + attn_scale·ln(1 + ⌊(p + 1) / floor_scale⌋)`
  per query, a position bias added as given, attention sinks as GPT-OSS's eager attention writes them (the sink
  concatenated as one more column, the softmax taken, the column dropped), and PyTorch's `_safe_softmax` rule (a
  query that may see no key gets zeros).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnscope.spec import AttentionSpec

FORMULA = "float64 formula"


@dataclass(frozen=True)
class Asked:
    """The attention as the user asked for it (its `AttentionSpec`, read as it is: `asked.spec.window`) and what
    lies outside the spec (the padded keys, a position bias): the reference is built from these and the raw inputs
    alone."""

    spec: AttentionSpec = AttentionSpec()
    pad: int = 0
    position_bias: Tensor | None = None  # added to the scores as given (the user's file): T5's relative bias

    @property
    def needs_formula(self) -> bool:
        spec = self.spec
        return (spec.softcap is not None or spec.alibi or spec.rope is not None or spec.temperature is not None
                or self.position_bias is not None or spec.sinks or spec.norm is not None)

    def rope_config(self, d_head: int) -> dict[str, Any]:
        """The RoPE asked for as a config.json would say it, for check_rope.rotate64: the type and its
        parameters as given, the base, the rotated fraction, the head size."""
        rope = self.spec.rope
        assert rope is not None
        parameters = {key: value for key, value in (rope.scaling or {}).items() if key != "type"}
        parameters.update(rope_type=rope.kind, rope_theta=rope.base, partial_rotary_factor=rope.fraction)
        config: dict[str, Any] = {"rope_parameters": parameters, "head_dim": d_head}
        if rope.max_position_embeddings is not None:
            config["max_position_embeddings"] = rope.max_position_embeddings
        return config


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
    offset = n_K - n_Q if asked.spec.align == "lower-right" else 0
    ones = torch.ones(n_Q, n_K, dtype=torch.bool)
    if asked.spec.window is not None and asked.spec.window_side == "both":  # |i - j| <= window // 2, no causal mask
        parts.append(ones.tril(diagonal=asked.spec.window // 2) & ones.triu(diagonal=-(asked.spec.window // 2)))
    elif asked.spec.window is not None:
        parts.append(ones.tril(diagonal=offset) & ~ones.tril(diagonal=offset - asked.spec.window))
    elif asked.spec.align:
        parts.append(ones.tril(diagonal=offset))
    if asked.spec.chunk is not None:
        parts.append(_chunks(n_Q, n_K, offset, asked.spec.chunk))
    if not parts:
        return None
    allowed = parts[0]
    for part in parts[1:]:
        allowed = allowed & part
    return allowed if allowed.dim() >= 2 else allowed.expand(n_Q, n_K)  # F.sdpa takes no 1-D mask


def _chunks(n_Q: int, n_K: int, offset: int, chunk: int) -> Tensor:
    """Same-chunk blocks over positions 0 .. P − 1 (`torch.block_diag` of ones), the queries' rows taken from
    `offset` on: `[n_Q, n_K]` boolean. Queries before position 0 (lower-right, n_Q > n_K) share no key's chunk."""
    n_pos = max(n_K, offset + n_Q)
    sizes = [min(chunk, n_pos - start) for start in range(0, n_pos, chunk)]
    blocks = torch.block_diag(*(torch.ones(size, size) for size in sizes)).bool()  # [n_pos, n_pos]
    before = torch.zeros(max(0, -offset), n_K, dtype=torch.bool)
    return torch.cat([before, blocks[max(0, offset) : offset + n_Q, :n_K]])


def sdpa_mask(user: Tensor | None, n_Q: int, n_K: int, asked: Asked,
               dtype: torch.dtype = torch.float32) -> tuple[object | None, bool]:
    """`attn_mask` and `is_causal` for F.scaled_dot_product_attention, built with PyTorch's own functions; a
    float mask takes the queries' `dtype`, as F.scaled_dot_product_attention requires."""
    boolean, additive = user_parts(user)
    additive = additive.to(dtype) if additive is not None else None
    alone = (boolean is None and additive is None and not asked.pad and asked.spec.window is None
             and asked.spec.chunk is None)
    if alone and asked.spec.align == "upper-left":
        return None, True
    allowed = allowed_mask(boolean, n_Q, n_K, asked)
    if additive is None:
        return allowed, False
    if allowed is None:
        return additive if additive.dim() >= 2 else additive.expand(n_Q, n_K), False
    return torch.where(allowed, additive, -math.inf), False


# --- the float64 formula ------------------------------------------------------------------------------------


def _rotated(x: Tensor, asked: Asked, start: int, seq_len: int) -> Tensor:
    """x at positions start .. start + n − 1 of a forward over 0 .. seq_len − 1, by check_rope.rotate64."""
    from attnscope.check.rope import rotate64

    assert asked.spec.rope is not None
    return rotate64(x, asked.rope_config(x.shape[-1]), start=start, seq_len=seq_len, pairing=asked.spec.rope.pairing)


def _temperature(q: Tensor, asked: Asked, start: int) -> Tensor:
    """Llama 4's temperature: query at position p times 1 + attn_scale·ln(1 + ⌊(p + 1) / floor_scale⌋), in
    float64 from Python's own floor and log."""
    tuning = asked.spec.temperature
    assert tuning is not None
    factors = [1.0 + tuning.attn_scale * math.log(1.0 + math.floor((p + 1) / tuning.floor_scale))
               for p in range(start, start + q.shape[-2])]
    return q * torch.tensor(factors, dtype=torch.float64)[:, None]


def rms_norm64(x: Tensor, weight: Tensor | None, eps: float, offset: bool = False) -> Tensor:
    """qk-norm's RMSNorm over the last axis in float64, by PyTorch's `F.rms_norm`; Gemma's weights are offsets
    from 1."""
    import torch.nn.functional as F

    w = None if weight is None else (1.0 + weight.double() if offset else weight.double())
    return F.rms_norm(x.double(), (x.shape[-1],), w, eps)


def qk_norm64(x: Tensor, weight: Tensor | None, bias: Tensor | None, norm: Any) -> Tensor:
    """qk-norm over the last axis in float64, of the norm's kind: `rms_norm64`, or a LayerNorm by PyTorch's
    `F.layer_norm` (timm's qk_norm=True with norm_layer=nn.LayerNorm)."""
    import torch.nn.functional as F

    if not norm.layer:
        return rms_norm64(x, weight, norm.eps, norm.offset)
    w, b = (None if t is None else t.double() for t in (weight, bias))
    return F.layer_norm(x.double(), (x.shape[-1],), w, b, norm.eps)


def formula(q: Tensor, k: Tensor, v: Tensor, user: Tensor | None, asked: Asked, *,
             q_start: int | None = None, k_start: int = 0, rotated_keys: int = 0,
             sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """out, attention in float64. Heads on axis -3 (K/V may have fewer, shared by groups of query heads).
    `rotated_keys` leading keys are taken as already rotated (and normed: a KV cache). A qk-norm here is sdpa's,
    of unit weight over d_K; a module's weighted one is applied by its caller before. `sinks` (one logit per
    head, or one for all) join each row as one more column, dropped after the softmax: the sink's weight is then
    `1 - attention.sum(-1)`."""
    q, k, v = q.double(), k.double(), v.double()
    n_Q, n_K, d = q.shape[-2], k.shape[-2], q.shape[-1]
    offset = n_K - n_Q if asked.spec.align == "lower-right" else 0
    q_start = offset if q_start is None else q_start
    if asked.spec.norm is not None:
        q = qk_norm64(q, None, None, asked.spec.norm)
        fresh = qk_norm64(k[..., rotated_keys:, :], None, None, asked.spec.norm)
        k = torch.cat([k[..., :rotated_keys, :], fresh], dim=-2)
    if asked.spec.rope is not None:
        seq_len = max(n_K + k_start, q_start + n_Q)  # the positions the forward covers (dynamic, longrope)
        q = _rotated(q, asked, q_start, seq_len)
        fresh = _rotated(k[..., rotated_keys:, :], asked, k_start + rotated_keys, seq_len)
        k = torch.cat([k[..., :rotated_keys, :], fresh], dim=-2)
    if asked.spec.temperature is not None:
        q = _temperature(q, asked, q_start)
    if q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        serving = torch.arange(q.shape[-3]) // (q.shape[-3] // k.shape[-3])  # the KV head of each query head
        k, v = k.index_select(-3, serving), v.index_select(-3, serving)
    scale = 1 / math.sqrt(d) if asked.spec.scale is None else asked.spec.scale
    s = torch.einsum("...qd,...kd->...qk", q, k) * scale  # [.., n_Q, d] @ [.., n_K, d]ᵀ -> [.., n_Q, n_K]
    if asked.spec.softcap is not None:
        s = asked.spec.softcap * torch.tanh(s / asked.spec.softcap)
    if asked.spec.alibi:
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        n_head = q.shape[-3] if q.dim() >= 4 else 1
        slope = build_alibi_tensor(torch.ones(1, 2), n_head, torch.float64)[:, 0, 1]  # [n_head]: BLOOM's m_h · 1
        # the paper's −m_h · (i − j), query i at q_start + i: BLOOM's m_h · j differs by m_h · i in each row, which
        # the softmax ignores but a sink's logit does not
        distance = torch.arange(n_Q, dtype=torch.float64)[:, None] + q_start - torch.arange(n_K, dtype=torch.float64)
        bias = -slope[:, None, None] * distance  # [n_head, n_Q, n_K]
        s = s + (bias if q.dim() >= 4 else bias[0])
    if asked.position_bias is not None:
        s = s + asked.position_bias.double()  # T5's eager_attention_forward: scores + position_bias, then the mask
    boolean, additive = user_parts(user)
    if additive is not None:
        s = s + additive.double()
    allowed = allowed_mask(boolean, n_Q, n_K, asked)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:  # GPT-OSS's eager attention: cat, softmax, drop the column
        # [n_head, 1, 1] or [1, 1]
        column = sinks.double().reshape(-1, 1, 1) if s.dim() >= 3 else sinks.double().reshape(1, 1)
        s = torch.cat([s, column.expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.where(torch.isneginf(s).all(dim=-1, keepdim=True), 0.0, p)  # PyTorch's _safe_softmax rule
    p = p[..., :-1] if sinks is not None else p
    return torch.einsum("...qk,...kd->...qd", p, v), p  # [.., n_Q, n_K] @ [.., n_K, d_V] -> [.., n_Q, d_V]
