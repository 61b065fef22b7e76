"""RoPE's inverse frequencies for every type transformers ships, as `modeling_rope_utils.ROPE_INIT_FUNCTIONS`
computes them, with the parameters of each type read and checked once.

`parse(kind, parameters, ...)` validates a `rope_parameters` dict (transformers 5) or `rope_scaling` dict (4.4x)
for one type and returns its values with transformers' defaults filled in; `frequencies(kind, values, ...)`
returns `inv_freq` (float32, one entry per rotated pair) and the attention scaling that multiplies cos and sin.

- default: `base^(-2i/dim)` (each family's `compute_default_rope_parameters`).
- linear: default / `factor` (`_compute_linear_scaling_rope_parameters`).
- dynamic (NTK): for a forward over `seq_len` positions beyond `max_position_embeddings`, the base grows to
  `base · (factor · seq_len / max_position_embeddings − (factor − 1))^(dim / (dim − 2))`
  (`_compute_dynamic_ntk_parameters` as `dynamic_rope_update` calls it, the new base in float32 because the
  length arrives as a tensor); within the context, the default frequencies. A fresh module is assumed: the one
  transformers keeps across calls remembers the longest length it has seen.
- yarn: each pair blends `base^(-2i/dim)` (kept above the correction range) with it divided by `factor`
  (below), on a linear ramp between the dimensions where a pair turns `beta_fast` and `beta_slow` times over
  `original_max_position_embeddings`; `truncate` floors and ceils that range; cos and sin are multiplied by
  `attention_factor`, by default `0.1 · ln(factor) + 1` (or `mscale`/`mscale_all_dim`'s ratio of the same).
- longrope: `1 / (ext · base^(2i/dim))` with `ext` the `short_factor` list, or `long_factor` once the forward
  covers more than `original_max_position_embeddings` positions (`longrope_frequency_update`); cos and sin
  times `attention_factor`, by default `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`.
- llama3: Llama 3.1's band-wise slow-down (`_compute_llama3_parameters`).
- proportional: `base^(-2i/head_dim)` for the first `partial_rotary_factor · head_dim / 2` pairs, 0 (no turn)
  for the others, over the whole head, then / `factor` (`_compute_proportional_rope_parameters`, Gemma 4).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from torch import Tensor

TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
# Keys each type cannot do without, after transformers' `standardize_rope_params` has filled
# original_max_position_embeddings from max_position_embeddings (`_validate_*_rope_parameters`).
REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
           "mscale_all_dim")
ZERO_IS_DEFAULT = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")  # transformers reads them with `or`


def check_kind(kind: Any, source: str) -> str:
    if not isinstance(kind, str) or kind not in TYPES:
        raise UsageError(f"RoPE type {kind!r} ({source}.rope_type) is not one attnscope computes; "
                         f"it computes {', '.join(TYPES)}")
    return kind


def parse(kind: str, parameters: Mapping[str, Any], source: str, max_positions: int | None) -> dict[str, Any]:
    """The values `frequencies` reads for `kind`, each checked (finite, positive, in range) by its key's name."""
    values: dict[str, Any] = {}
    for key in NUMBERS:
        value = parameters.get(key)
        if value is not None:
            minimum = 0.0 if key in ZERO_IS_DEFAULT else None
            values[key] = _number(value, f"{source}.{key}", minimum)
    original = parameters.get("original_max_position_embeddings", max_positions)
    if original is not None:
        values["original_max_position_embeddings"] = whole(original, f"{source}.original_max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        if parameters.get(key) is not None:
            values[key] = _factors(parameters[key], f"{source}.{key}")
    truncate = parameters.get("truncate", True)
    if not isinstance(truncate, bool):
        raise UsageError(f"{source}.truncate is {truncate!r}; it must be true or false")
    values["truncate"] = truncate
    for key in ("beta_fast", "beta_slow"):  # yarn's correction_dim takes log(original / (beta · 2π)): finite, > 0
        beta, held = values.get(key), values.get("original_max_position_embeddings") or 1
        if beta and not 0 < held / (beta * 2 * math.pi) < math.inf:
            raise UsageError(f"{source}.{key} is {beta:g}; yarn turns it into a dimension by log(original / "
                             f"({key} · 2π)), which it makes {'0' if beta > 1 else 'infinite'}; give a number near "
                             "yarn's own (beta_fast 32, beta_slow 1)")
    for key in REQUIRED.get(kind, ()):
        if key not in values and not (kind == "yarn" and key == "factor" and "factor" in parameters):
            hint = " (or max_position_embeddings, which transformers takes for it)" \
                if key == "original_max_position_embeddings" else ""
            raise UsageError(f"RoPE type {kind!r} needs {source}.{key}{hint}")
    if kind == "llama3" and not values["high_freq_factor"] > values["low_freq_factor"]:
        raise UsageError(f"{source}.high_freq_factor ({values['high_freq_factor']:g}) must be above "
                         f"low_freq_factor ({values['low_freq_factor']:g}); Llama 3.1 uses 4 and 1")
    if kind == "longrope" and values.get("attention_factor") is None \
            and values.get("original_max_position_embeddings") == 1:  # transformers' _compute_longrope_parameters
        raise UsageError(f"{source}.original_max_position_embeddings is 1; longrope scales cos and sin by "
                         "sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), which divides by ln 1 = 0; "
                         "give the length the model was trained on (Phi-3's 4096), or attention_factor")
    if kind == "dynamic" and max_positions is None:
        raise UsageError("RoPE type 'dynamic' needs max_position_embeddings, the length beyond which it rescales")
    if kind in ("yarn", "longrope") and values.get("factor") is None and max_positions is None \
            and (kind == "yarn" or values.get("attention_factor") is None):
        raise UsageError(f"RoPE type {kind!r} needs {source}.factor (or max_position_embeddings, whose ratio to "
                         "original_max_position_embeddings transformers then takes)")
    return values


MOST = 2**53  # the largest whole number float64 holds exactly: a length or size beyond it is no model's


def whole(value: Any, name: str) -> int:
    """A whole number from 1 to MOST (a float that is one, 4096.0, read as it): a count of tokens or of features.
    Beyond MOST (1e308 in a config) it would overflow the float32 arithmetic of the frequencies that read it."""
    given = value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} is {given!r}; it must be a whole number of at least 1")
    if value > MOST:
        raise UsageError(f"{name} is {given!r}; it must be a whole number from 1 to 2^53 ({MOST:,}), a length or "
                         "size a model can have")
    return value


def _number(value: Any, name: str, minimum: float | None) -> float:
    """A finite number above 0 (at least `minimum` where that is given)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (value <= 0 if minimum is None else value < minimum):
        rule = "above 0" if minimum is None else f"at least {minimum:g}"
        raise UsageError(f"{name} is {value!r}; it must be a finite number {rule}")
    return float(value)


def _factors(value: Any, name: str) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise UsageError(f"{name} is {value!r}; it must be a list of numbers, one per rotated pair")
    return tuple(_number(v, f"{name}[{i}]", None) for i, v in enumerate(value))


def attention_scaling(kind: str, values: Mapping[str, Any], max_positions: int | None) -> float:
    """What cos and sin are multiplied by (`attention_factor`, mscale): 1 except for yarn and longrope."""
    given = values.get("attention_factor")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if given is not None:
        return float(given)
    factor = _factor(values, max_positions)
    if kind == "longrope":
        original = values["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = values.get("mscale"), values.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
    return _mscale(factor)


def _factor(values: Mapping[str, Any], max_positions: int | None) -> float:
    """yarn's and longrope's `factor`, or max_position_embeddings / original_max_position_embeddings."""
    if values.get("factor") is not None:
        return float(values["factor"])
    assert max_positions is not None  # parse() refused the rope otherwise
    return max_positions / values["original_max_position_embeddings"]


def _mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def frequencies(kind: str, values: Mapping[str, Any], base: float, head_dim: int, fraction: float,
                seq_len: int | None, max_positions: int | None) -> Tensor:
    """`inv_freq` in float32 for a forward over positions 0 .. seq_len − 1 (None: as a module starts)."""
    import torch

    if kind == "proportional":
        return _proportional(values, base, head_dim, fraction)
    dim = int(head_dim * fraction)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim / 2]
    if kind == "dynamic" and seq_len is not None and max_positions is not None and seq_len > max_positions:
        grown = torch.tensor(seq_len)  # int64, as `torch.max(position_ids) + 1` is
        factor = values["factor"]
        new_base = base * ((factor * grown / max_positions) - (factor - 1)) ** (dim / (dim - 2))  # float32
        return 1.0 / (new_base ** exponents)
    if kind == "dynamic":
        factor = values["factor"]
        base = base * ((factor * max_positions / max_positions) - (factor - 1)) ** (dim / (dim - 2))  # type: ignore[operator]
    if kind == "yarn":
        return _yarn(values, base, dim, max_positions)
    if kind == "longrope":
        long = seq_len is not None and seq_len > values["original_max_position_embeddings"]
        ext = torch.tensor(values["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base**exponents)
    inv_freq = 1.0 / (base**exponents)
    if kind == "linear":
        return inv_freq / values["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, values)
    return inv_freq


def _proportional(values: Mapping[str, Any], base: float, head_dim: int, fraction: float) -> Tensor:
    import torch

    rope_angles = int(fraction * head_dim // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - rope_angles)))  # [head_dim / 2]
    return inv_freq / values.get("factor", 1.0)


def yarn_range(values: Mapping[str, Any], base: float, dim: int) -> tuple[float, float]:
    """The pairs between which yarn's ramp runs (`find_correction_range`)."""
    beta_fast, beta_slow = values.get("beta_fast") or 32, values.get("beta_slow") or 1
    original = values["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if values["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(values: Mapping[str, Any], base: float, dim: int, max_positions: int | None) -> Tensor:
    """`_compute_yarn_parameters`, operation for operation."""
    import torch

    factor = _factor(values, max_positions)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # [dim / 2]
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low, high = yarn_range(values, base, dim)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # 1: extrapolated (the original frequency), 0: interpolated (divided by factor)
    return interpolation * (1 - kept) + extrapolation * kept


def _llama3(inv_freq: Tensor, values: Mapping[str, Any]) -> Tensor:
    """Llama 3.1's frequency scaling, as transformers' `_compute_llama3_parameters` computes it."""
    import torch

    factor, low, high = values["factor"], values["low_freq_factor"], values["high_freq_factor"]
    old_context = values["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # low frequencies: slowed down
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def describe(kind: str, values: Mapping[str, Any], base: float, dim: int, d_name: str, seq_len: int,
             max_positions: int | None, fraction: float = 1.0) -> str:
    """inv_freq as the cos/sin steps say it: `500000^(-2i/d_head), llama3 (factor 8, ...)`."""
    plain = f"{base:g}^(-2i/{d_name})"
    if kind == "default":
        return plain
    if kind == "linear":
        return f"{plain} / {values['factor']:g} (linear)"
    if kind == "proportional":
        angles = int(fraction * dim // 2)
        return (f"{plain} / {values.get('factor', 1.0):g} for pairs i < {angles}, 0 for the others "
                f"(proportional, partial_rotary_factor {fraction:g})")
    if kind == "dynamic":
        if max_positions is not None and seq_len > max_positions:
            return (f"base'^(-2i/{d_name}), base' = {base:g} · ({values['factor']:g} · {seq_len}/{max_positions}"
                    f" − {values['factor'] - 1:g})^(d/(d−2)) (dynamic NTK, n_pos {seq_len} > {max_positions})")
        return f"{plain} (dynamic NTK, unscaled: n_pos {seq_len} ≤ max_position_embeddings {max_positions})"
    original = values["original_max_position_embeddings"]
    if kind == "longrope":
        which = "long" if seq_len > original else "short"
        sign = ">" if which == "long" else "≤"
        return f"{plain} / {which}_factor[i] (longrope, n_pos {seq_len} {sign} {original})"
    if kind == "yarn":
        low, high = yarn_range(values, base, dim)
        return (f"{plain}, ÷ {_factor(values, max_positions):g} from pair {high:g} on, blended over pairs "
                f"{low:g}-{high:g} (yarn, original {original})")
    return (f"{plain}, llama3-scaled (factor {values['factor']:g}, low_freq_factor {values['low_freq_factor']:g},"
            f" high_freq_factor {values['high_freq_factor']:g}, original {original})")
