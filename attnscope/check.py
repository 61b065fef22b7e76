"""`--check`: the user's raw inputs through PyTorch's own attention, compared tensor by tensor.

The reference never reads a tensor attnscope produced, and never calls attnscope's attention, mask or
position code: it starts again from the raw inputs (as loaded from the user's files, or drawn at random)
and the options in the user's own words (`Asked`), and builds everything with PyTorch's functions.

- Masks: the file's mask read as the documented rule says (boolean; integers `!= 0`; floats added),
  padding as a boolean row, causal through `is_causal=True` when it is the only mask, else
  `torch.ones(...).tril(diagonal=n_K - n_Q)` for lower-right (what `torch.nn.attention.bias.causal_lower_right`
  materializes, tests/test_check.py; importing that module imports torch's compiler, which costs seconds and
  writes $TMPDIR/torchinductor_*), a sliding window as the difference of two `tril`s, all combined by AND.
- sdpa: `F.scaled_dot_product_attention` (with `enable_gqa` for fewer K/V heads). Where PyTorch has no
  kernel for what was asked (softcapping, RoPE, ALiBi) the reference is the formula in float64: RoPE as
  the rotation of complex numbers `x_i + i·x_{i+d/2}` by `e^{i·p·θ_i}`, ALiBi from BLOOM's
  `build_alibi_tensor` (transformers), softcap `C·tanh(s / C)`, and PyTorch's `_safe_softmax` rule
  (a query that may see no key gets zeros).
- mha: `torch.nn.MultiheadAttention` with the module's weights copied in, and `F.scaled_dot_product_attention`
  on Q, K, V projected here with `F.linear`; for the variants nn.MultiheadAttention cannot express
  (grouped K/V heads, RoPE, softcap, ALiBi, a decoupled d_head, a KV cache, another scale) the float64
  formula above with the projections done by `einsum`. nn.MultiheadAttention takes boolean masks the other
  way round (True = masked out), so they are inverted for it.
- Comparison is NaN-aware: a NaN where the reference has a NaN agrees; a NaN on one side only fails,
  and says how many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from attnscope.spec import AttentionSpec

if TYPE_CHECKING:
    from torch import Tensor

    from attnscope.multihead import MultiHeadAttention
    from attnscope.trace import Trace

# atol, rtol per dtype: what a different but correct summation order can give.
TOLERANCES = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
FORMULA = "float64 formula"


@dataclass(frozen=True)
class Comparison:
    name: str
    reference: str
    max_abs_diff: float
    tolerance: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance  # NaN and inf never pass


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
    def needs_formula(self) -> bool:
        return self.softcap is not None or self.alibi or self.rope_base is not None


def tolerance(*dtypes: torch.dtype) -> tuple[float, float]:
    """The looser of the dtypes' (atol, rtol): a float32 attention checked against PyTorch's float16 one can
    only agree to float16's precision."""
    pairs = [TOLERANCES.get(dtype, TOLERANCES[torch.float32]) for dtype in dtypes]
    return max(a for a, _ in pairs), max(r for _, r in pairs)


def compare(name: str, reference_name: str, ours: Tensor, reference: Tensor) -> Comparison:
    """Max |ours - reference| against `atol + rtol * max|reference|`, NaN-aware: equal NaN and equal infinite
    positions agree; a NaN on one side only is a failure, counted in `detail`."""
    atol, rtol = tolerance(ours.dtype, reference.dtype)
    if ours.shape != reference.shape:
        return Comparison(name, reference_name, math.inf, 0.0,
                          f"shape {list(ours.shape)} but the reference is {list(reference.shape)}")
    if not ours.numel():
        return Comparison(name, reference_name, 0.0, atol)
    ours, reference = ours.detach(), reference.detach().to(ours.dtype)
    # One temporary in the tensors' own dtype (the compared tensors may be as large as the attention itself;
    # float64 copies would triple the memory --check needs).
    diff = torch.sub(ours, reference).abs_()
    nan_ours, nan_ref = torch.isnan(ours), torch.isnan(reference)
    lonely = int((nan_ours ^ nan_ref).sum())
    diff.masked_fill_(nan_ours & nan_ref, 0.0)
    diff.masked_fill_(torch.isinf(ours) & (ours == reference), 0.0)  # inf - inf is NaN, but they agree
    diff.masked_fill_(nan_ours ^ nan_ref, math.inf)
    finite = reference[torch.isfinite(reference)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    detail = ""
    if lonely:
        detail = f"{lonely} NaN on one side only (attnscope {int(nan_ours.sum())}, reference {int(nan_ref.sum())})"
    elif bool(nan_ours.any()):
        detail = f"{int(nan_ours.sum())} NaN on both sides, in the same places"
    return Comparison(name, reference_name, float(diff.max()), atol + rtol * scale, detail)


def input_note(inputs: dict[str, Tensor | None]) -> str | None:
    """How many NaN and Inf the user's inputs held, the first thing to know when a check fails."""
    counts = []
    for name, tensor in inputs.items():
        if tensor is None or not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        if nan or inf:
            counts.append(f"{name}: {nan} NaN, {inf} Inf")
    return "the inputs hold non-finite numbers (" + "; ".join(counts) + ")" if counts else None


# --- the reference mask, from the user's words ----------------------------------------------------------


def _user_parts(user: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """The file's mask as the rule reads it: (boolean part, additive part)."""
    if user is None:
        return None, None
    if user.dtype == torch.bool:
        return user, None
    if user.is_floating_point():
        return None, user
    return user != 0, None  # integer 0/1 (the run refused any other integer)


def _allowed(user: Tensor | None, n_Q: int, n_K: int, asked: Asked) -> Tensor | None:
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


def _sdpa_mask(user: Tensor | None, n_Q: int, n_K: int, asked: Asked,
               dtype: torch.dtype = torch.float32) -> tuple[object | None, bool]:
    """`attn_mask` and `is_causal` for F.scaled_dot_product_attention, built with PyTorch's own functions; a
    float mask takes the queries' `dtype`, as F.scaled_dot_product_attention requires."""
    boolean, additive = _user_parts(user)
    additive = additive.to(dtype) if additive is not None else None
    alone = boolean is None and additive is None and not asked.pad and asked.window is None
    if alone and asked.causal == "upper-left":
        return None, True
    allowed = _allowed(boolean, n_Q, n_K, asked)
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


def _formula(q: Tensor, k: Tensor, v: Tensor, user: Tensor | None, asked: Asked, *,
             q_start: int | None = None, k_start: int = 0, rotated_keys: int = 0) -> tuple[Tensor, Tensor]:
    """out, attention in float64. Heads on axis -3 (K/V may have fewer, shared by groups of query heads).
    `rotated_keys` leading keys are taken as already rotated (a KV cache)."""
    q, k, v = q.double(), k.double(), v.double()
    n_Q, n_K, d = q.shape[-2], k.shape[-2], q.shape[-1]
    offset = n_K - n_Q if asked.causal == "lower-right" else 0
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
    boolean, additive = _user_parts(user)
    if additive is not None:
        s = s + additive.double()
    allowed = _allowed(boolean, n_Q, n_K, asked)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, dim=-1)
    p = torch.where(torch.isneginf(s).all(dim=-1, keepdim=True), 0.0, p)  # PyTorch's _safe_softmax rule
    return torch.einsum("...qk,...kd->...qd", p, v), p


# --- sdpa ----------------------------------------------------------------------------------------------------


def as_float(*tensors: Tensor) -> list[Tensor]:
    """What a user's raw tensors become for PyTorch: integers to float32, mixed floats to the wider one."""
    floats = [t if t.is_floating_point() else t.float() for t in tensors]
    dtype = floats[0].dtype
    for t in floats[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return [t.to(dtype) for t in floats]


def check_sdpa(trace: Trace, raw: dict[str, Tensor], user: Tensor | None, asked: Asked,
               layout: str = "row") -> list[Comparison]:
    """`raw`: the inputs as the user gave them (Q, K, V, or X, W_Q, W_K, W_V for the matrix form)."""
    if "X" in raw:
        X, W_Q, W_K, W_V = as_float(raw["X"], raw["W_Q"], raw["W_K"], raw["W_V"])
        if layout == "col":
            Q, K, V = W_Q @ X, W_K @ X, W_V @ X  # [.., d, p] @ [.., p, n] -> [.., d, n]
        else:
            Q, K, V = X @ W_Q, X @ W_K, X @ W_V  # [.., n, p] @ [.., p, d] -> [.., n, d]
    else:
        Q, K, V = as_float(raw["Q"], raw["K"], raw["V"])
    col = layout == "col"
    if col:  # the column form against the row form on the transposed inputs, transposed back
        Q, K, V = (t.transpose(-2, -1) for t in (Q, K, V))
        if user is not None:  # the form's mask is [.., n_K, n_Q]: a 1-D one runs along the queries
            user = user.transpose(-2, -1) if user.dim() >= 2 else user.unsqueeze(-1)
    n_Q, n_K = Q.shape[-2], K.shape[-2]
    gqa = Q.dim() >= 3 and K.dim() >= 3 and Q.shape[-3] != K.shape[-3]
    if asked.needs_formula:
        out, attention = _formula(Q, K, V, user, asked)
        rows = [(trace["out"], out.transpose(-2, -1) if col else out, FORMULA)]
        if not col:
            rows.append((trace["attention"], attention, FORMULA))
    else:
        attn_mask, is_causal = _sdpa_mask(user, n_Q, n_K, asked, Q.dtype)
        with torch.no_grad():
            out = F.scaled_dot_product_attention(Q, K, V, attn_mask=attn_mask, is_causal=is_causal,  # type: ignore[arg-type]
                                                 scale=asked.scale, enable_gqa=gqa)
        name = "F.scaled_dot_product_attention" + ("(row form)ᵀ" if col else "")
        rows = [(trace["out"], out.transpose(-2, -1) if col else out, name)]
    names = ("out", "attention")
    return [compare(names[i], reference, ours, ref) for i, (ours, ref, reference) in enumerate(rows)]


# --- mha -------------------------------------------------------------------------------------------------------


def _plain(module: MultiHeadAttention, cache: tuple[Tensor, Tensor] | None, asked: Asked) -> bool:
    """What torch.nn.MultiheadAttention can hold: equal heads, d_head = d_feat / n_head, its own scale."""
    return (module.n_kv_head == module.n_head and module.n_head * module.d_head == module.d_feat
            and cache is None and not asked.needs_formula and asked.scale is None)


def reference_mha(module: MultiHeadAttention) -> torch.nn.MultiheadAttention:
    """A torch.nn.MultiheadAttention holding exactly this module's weights."""
    bias = module.W_q.bias is not None
    ref = torch.nn.MultiheadAttention(module.d_feat, module.n_head, bias=bias, batch_first=True,
                                      device=module.W_q.weight.device, dtype=module.W_q.weight.dtype)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([module.W_q.weight, module.W_k.weight, module.W_v.weight]))
        ref.out_proj.weight.copy_(module.W_o.weight)
        if bias:
            ref.in_proj_bias.copy_(torch.cat([module.W_q.bias, module.W_k.bias, module.W_v.bias]))
            ref.out_proj.bias.copy_(module.W_o.bias)
    return ref.eval()


def _heads(x: Tensor, weight: Tensor, bias: Tensor | None, n_head: int) -> Tensor:
    """[n_batch, n, d_feat] -> [n_batch, n_head, n, d_head] by F.linear, reshape and transpose."""
    projected = F.linear(x, weight, bias)  # [n_batch, n, n_head·d_head]
    d_head = weight.shape[0] // n_head  # not -1: an empty batch has no size to infer it from
    return projected.reshape(x.shape[0], x.shape[1], n_head, d_head).transpose(1, 2)


def check_mha(module: MultiHeadAttention, trace: Trace, Q: Tensor, K: Tensor, V: Tensor, user: Tensor | None,
              asked: Asked, cache: tuple[Tensor, Tensor] | None = None) -> list[Comparison]:
    """x_raw, attention and x against PyTorch (plain modules) or the float64 formula (the variants).
    `user` is the raw mask file: a 3-D mask `[n_batch, n_Q, n_K]` is shared by every head."""
    if user is not None and user.dim() == 3:
        user = user.unsqueeze(1)
    weights = {name: getattr(module, name) for name in ("W_q", "W_k", "W_v", "W_o")}
    if not _plain(module, cache, asked) or not (Q.numel() and K.numel()):  # nn.MultiheadAttention: no empty batch
        return _check_mha_formula(module, trace, Q, K, V, user, asked, cache)
    with torch.no_grad():
        q, k, v = (_heads(x, weights[w].weight, weights[w].bias, module.n_head)
                   for x, w in ((Q, "W_q"), (K, "W_k"), (V, "W_v")))
        n_Q, n_K = q.shape[-2], k.shape[-2]
        attn_mask, is_causal = _sdpa_mask(user, n_Q, n_K, asked, q.dtype)
        inner = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)  # type: ignore[arg-type]
        rows = [compare("x_raw", "F.scaled_dot_product_attention", trace["x_raw"], inner)]
        boolean, additive = _user_parts(user)
        allowed = _allowed(boolean, n_Q, n_K, asked)
        full = (Q.shape[0], module.n_head, n_Q, n_K)
        ref_mask = None
        if allowed is not None or additive is not None:
            # nn.MultiheadAttention: boolean True = masked OUT, shape [n_batch * n_head, n_Q, n_K]
            mask = torch.zeros(full, dtype=Q.dtype)
            if additive is not None:
                mask = mask + additive.to(Q.dtype)
            if allowed is not None:
                mask = mask.masked_fill(~allowed, -math.inf)
            ref_mask = mask.reshape(-1, n_Q, n_K)
        x, attention = reference_mha(module)(Q, K, V, attn_mask=ref_mask, need_weights=True,
                                             average_attn_weights=False)
    # nn.MultiheadAttention gives NaN for a query that may attend to no key, where PyTorch's SDPA (and
    # attnscope) give 0 (_safe_softmax): its weights get that rule, and x is projected again from them.
    if ref_mask is not None:
        blocked = torch.isneginf(ref_mask.reshape(full)).all(dim=-1, keepdim=True)  # [n_batch, n_head, n_Q, 1]
        if bool(blocked.any()):
            attention = attention.masked_fill(blocked, 0.0)
            merged = (attention @ v).transpose(1, 2).reshape(Q.shape[0], n_Q, -1)  # [n_batch, n_Q, d_feat]
            x = F.linear(merged, module.W_o.weight, module.W_o.bias)
    rows.append(compare("attention", "nn.MultiheadAttention", trace["attention"], attention))
    rows.append(compare("x", "nn.MultiheadAttention", trace["x"], x))
    return rows


def _check_mha_formula(module: MultiHeadAttention, trace: Trace, Q: Tensor, K: Tensor, V: Tensor,
                       user: Tensor | None, asked: Asked, cache: tuple[Tensor, Tensor] | None) -> list[Comparison]:
    def project(x: Tensor, name: str, heads: int) -> Tensor:  # in float64: [n_batch, heads, n, d_head]
        layer = getattr(module, name)
        return _heads(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double(), heads)

    with torch.no_grad():
        q = project(Q, "W_q", module.n_head)
        k, v = project(K, "W_k", module.n_kv_head), project(V, "W_v", module.n_kv_head)
        n_cache = 0
        if cache is not None:
            n_cache = cache[0].shape[-2]
            k, v = torch.cat([cache[0].double(), k], dim=-2), torch.cat([cache[1].double(), v], dim=-2)
        n_Q, n_K = q.shape[-2], k.shape[-2]
        q_start = n_cache if cache is not None else (n_K - n_Q if asked.causal == "lower-right" else 0)
        x_raw, attention = _formula(q, k, v, user, asked, q_start=q_start, rotated_keys=n_cache)
        width = module.n_head * module.d_head
        merged = x_raw.transpose(1, 2).reshape(Q.shape[0], n_Q, width)  # [n_batch, n_Q, n_head·d_head]
        x = torch.einsum("bnh,fh->bnf", merged, module.W_o.weight.double())
        if module.W_o.bias is not None:
            x = x + module.W_o.bias.double()
    return [compare("x_raw", FORMULA, trace["x_raw"], x_raw),
            compare("attention", FORMULA, trace["attention"], attention), compare("x", FORMULA, trace["x"], x)]
