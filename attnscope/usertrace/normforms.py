"""A qk-norm's form read from the user's own norm module, by experiment: the module is run on a probe and its output
fitted by each form the reference's qk-norm computes (variants/qknorm.py), never read from its class or names.

- RMSNorm, `x · rsqrt(mean(x²) + eps) · g` (Qwen3, OLMo 2; eps outside the root, `x / (√mean(x²) + eps)`, is the
  same within tolerance for the epsilons models use), or LayerNorm, `(x − mean) · rsqrt(var + eps) · g + b` (timm's
  default norm_layer, and a LayerNorm written by hand);
- its per-channel gain `g` solved from the probe, then read as the module's 1-D weight `w` (`g = w`), as Gemma's
  offset from 1 (`g = 1 + w`, Gemma3RMSNorm's `x · (1 + weight)`), or, where neither, as the gain itself (a
  weight under another name, `exp(w)`, a scale folded in);
- a gain of one row per head (Cohere's `CohereLayerNorm((n_head, d_head))`, a weight `[n_head, d_head]` over
  `[.., n_head, d_head]`; `[n_head, 1, d_head]` over `[.., n_head, n, d_head]`): the probe is laid out as the
  weight is, each row of it normalized over its last axis, and the gain solved per cell, `[rows, width]`;
- its epsilon the module's own attribute (`eps`, `variance_epsilon`, `epsilon`), else the form's default.

A form is kept only where it gives the module's output back to float32's tolerance on every probe row, rows of
small magnitude included (there the epsilon shows). None where no form fits, or the module does not run on a probe
of its width: the reference then reads the module as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

EPS_NAMES = ("eps", "variance_epsilon", "epsilon", "norm_eps", "layer_norm_eps", "rms_norm_eps")
DEFAULT_EPS = {"rms": 1e-6, "layer": 1e-5}


@dataclass(frozen=True)
class NormForm:
    """What the user's norm computes: its kind ("rms" or "layer"), whether its weight is an offset from 1, its
    epsilon, and the weight and bias the reference's norm takes (`weight` is the module's own w where `offset` or
    `g = w`, else the solved gain)."""

    kind: str
    offset: bool
    eps: float
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    how: str  # "its weight", "1 + its weight", "a gain of its own"


def _over(p: torch.Tensor, width: int) -> bool:
    """Whether a parameter spans a last axis of `width`, or `width` cells laid out over several axes (the
    `[n_head, d_head]` weight of `nn.LayerNorm((n_head, d_head))`, one norm over the whole projection)."""
    return p.dim() >= 1 and (p.shape[-1] == width or p.dim() > 1 and p.numel() == width)


def weight_of(norm: nn.Module, width: int) -> torch.Tensor | None:
    """The norm's weight over a last axis of `width`: `weight`, else its only such parameter (`scale`, `gamma`,
    `g`); 1-D `[width]`, a row per head (`[n_head, width]`, `[n_head, 1, width]`), or `width` cells over several
    axes (`[n_head, d_head]` of a norm over the whole projection)."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and _over(weight, width):
        return weight.detach()
    found = [p for name, p in norm.named_parameters() if _over(p, width)
             and "bias" not in name and "beta" not in name]
    return found[0].detach() if len(found) == 1 else None


def shaped(norm: nn.Module, width: int) -> torch.Tensor | None:
    """The norm's largest parameter over a last axis of `width` (its weight, or a bias as wide: the layout a
    probe takes, a row per head where it holds them; `width` cells over several axes, a norm over them all),
    whatever it is called; None where it holds none."""
    found = [p.detach() for p in norm.parameters() if _over(p, width)]
    return max(found, key=lambda p: p.numel()) if found else None


def rows(form: NormForm) -> int:
    """How many gains the form holds, one per head (1: one gain that every head shares)."""
    return 1 if form.weight is None or form.weight.dim() == 1 else int(form.weight.shape[0])


def own_eps(norm: nn.Module) -> float | None:
    """The norm's epsilon attribute; nn.RMSNorm's `eps=None` is its dtype's machine epsilon."""
    for name in EPS_NAMES:
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    if "eps" in vars(norm) and norm.eps is None:
        dtype = next((p.dtype for p in norm.parameters() if p.is_floating_point()), torch.float32)
        return float(torch.finfo(dtype).eps)
    return None


def read(norm: nn.Module, width: int) -> NormForm | None:
    """The form `norm` computes over a last axis of `width`, fitted on a probe laid out as its weight is (a row per
    head where it holds one; `width` cells over several axes, `nn.LayerNorm((n_head, d_head))`'s weight of a norm
    over the whole projection, laid out so and normalized over them all); None where none fits. The form's weight
    and bias are `[width]`, or `[rows, width]` with a gain per head."""
    weight, widest = weight_of(norm, width), shaped(norm, width)
    if weight is not None and widest is not None and weight.numel() != widest.numel():
        weight = None
    whole = widest is not None and widest.shape[-1] != width  # one norm over cells laid out over several axes
    layout = (1,) if widest is None or whole else tuple(widest.shape[:-1]) or (1,)  # the heads' axes of its weight
    probe = _probe(width, norm, layout)
    if probe is None:
        return None
    laid = probe.reshape(len(probe), *widest.shape) if whole and widest is not None else probe
    try:
        with torch.no_grad():
            out = norm(laid)
    except Exception:  # the user's module, on a probe: any failure means no reading
        return None
    if not isinstance(out, torch.Tensor) or out.shape != laid.shape or not out.is_floating_point():
        return None
    heads = 1 if whole else math.prod(layout)
    x, y = probe.double().reshape(-1, heads * width), out.double().reshape(-1, heads * width)  # [rows, cells]
    if weight is not None:
        weight = weight.reshape(heads, width) if heads > 1 else weight.reshape(width)
    eps_said = own_eps(norm)
    tries = [(kind, eps, root) for kind in ("rms", "layer")
             for eps in ((eps_said,) if eps_said is not None else _epsilons(kind)) for root in ("inside", "outside")]
    for kind, eps, root in tries:
        base = _normalized(x.reshape(-1, width), kind, eps, root).reshape(x.shape)  # each head over width
        fitted = _fit(base, y, with_bias=kind == "layer")
        if fitted is None:
            continue
        gain, bias = fitted
        if heads > 1:
            gain, bias = gain.reshape(heads, width), None if bias is None else bias.reshape(heads, width)
        if bias is not None and float(bias.abs().max()) <= _tol(y):
            bias = None
        if kind == "rms" and bias is not None:
            continue  # an RMSNorm with a bias is no form of the reference's
        found = _weight(gain, weight)
        if found is None:
            continue
        tensor, offset, how = found
        dtype = next((p.dtype for p in norm.parameters()), probe.dtype)
        return NormForm(kind, offset, eps, tensor.to(dtype), None if bias is None else bias.to(dtype), how)
    return None


def _epsilons(kind: str) -> tuple[float, ...]:
    """The epsilons to try for a norm that keeps none as an attribute (a literal in its code, `F.layer_norm(..,
    eps=1e-6)`): the kind's default first, then those models use."""
    return (DEFAULT_EPS[kind], *(e for e in (1e-5, 1e-6, 1e-8, 1e-12) if e != DEFAULT_EPS[kind]))


def _probe(width: int, norm: nn.Module, layout: tuple[int, ...] = (1,)) -> torch.Tensor | None:
    """Rows of `width` values at magnitudes 3, 1, 0.1 and 0.01 (where an epsilon of 1e-4 already shows), in the
    norm's dtype and device, seeded: the same probe every run. `[8, width]`, or laid out as a weight with a row
    per head is, `[8, *layout, width]`."""
    if width < 2:
        return None
    param = next(norm.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(1234)
    heads = math.prod(layout)
    rows = torch.randn(8, heads * width, generator=g, dtype=torch.float64) + 0.3  # a mean not 0: LayerNorm shows
    rows = rows * torch.tensor([3.0, 1.0, 1.0, 0.3, 0.1, 0.1, 0.01, 0.01], dtype=torch.float64)[:, None]
    rows = rows.reshape(8, *layout, width) if heads > 1 else rows
    return rows.to(torch.float32).to(device)


def _normalized(x: torch.Tensor, kind: str, eps: float, root: str) -> torch.Tensor:
    if kind == "layer":
        x = x - x.mean(-1, keepdim=True)
    power = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(power + eps) if root == "inside" else x / (power.sqrt() + eps)


def _fit(base: torch.Tensor, y: torch.Tensor, with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Per channel, y = base · g (+ b) by least squares; None where it leaves more than float32's tolerance."""
    if with_bias:
        ones = torch.ones_like(base)
        # per channel c: [rows, 2] @ [2] = y[:, c]
        a = torch.stack((base, ones), dim=-1).permute(1, 0, 2)  # [width, rows, 2]
        solution = torch.linalg.lstsq(a, y.t().unsqueeze(-1)).solution.squeeze(-1)  # [width, 2]
        gain, bias = solution[:, 0], solution[:, 1]
        fitted = base * gain + bias
    else:
        gain = (base * y).sum(0) / base.pow(2).sum(0).clamp_min(1e-300)  # [width]
        bias = None
        fitted = base * gain
    if float((fitted - y).abs().max()) > _tol(y):
        return None
    return gain, bias


def _weight(gain: torch.Tensor, weight: torch.Tensor | None) -> tuple[torch.Tensor, bool, str] | None:
    tol = 1e-4 * max(1.0, float(gain.abs().max()))
    if weight is not None and weight.shape == gain.shape:
        w = weight.double()
        if float((gain - w).abs().max()) <= tol:
            return weight, False, "its weight"
        if float((gain - (1.0 + w)).abs().max()) <= tol:
            return weight, True, "1 + its weight (weights stored as offsets from 1, Gemma's)"
    return gain, False, "a gain of its own, solved from what it computes"


def _tol(y: torch.Tensor) -> float:
    return 1e-5 + 1e-4 * float(y.abs().max())


def describe(form: NormForm) -> str:
    kind = "a LayerNorm" if form.kind == "layer" else "an RMSNorm"
    per_head = f", a row of it per head ({rows(form)})" if rows(form) > 1 else ""
    return f"{kind} (eps {form.eps:g}) scaled by {form.how}{per_head}{', with a bias' if form.bias is not None else ''}"

