"""The options `sdpa` and `mha` share, checked once, and the `AttentionSpec` they ask for.

Flags are words of the command line, so they may be named here (runs/ sits just under cli/); below runs/, a
check names the parameter and the command line words it as a flag (errors.AttnscopeError.worded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError
from attnscope.spec import divisors_near

if TYPE_CHECKING:
    from attnscope.spec import AttentionSpec
    from attnscope.variants.rope import Rope
    from attnscope.variants.temperature import TemperatureTuning

# PyTorch's sizes and seeds are 64-bit integers; a larger one gets a C++ backtrace out of torch.
INT64 = 2**63
ROPE_BASE = 10000.0  # LLaMA's, when --rope is given without --rope-base


@dataclass
class AttentionOptions:
    """Options `sdpa` and `mha` share."""

    seed: int = 0
    q: str | None = None
    k: str | None = None
    v: str | None = None
    causal: str | None = None  # "upper-left" or "lower-right"
    mask: str | None = None
    pad: int = 0
    check: bool = False
    meta: bool = False
    max_memory: int | None = None
    save: str | None = None
    force: bool = False
    heatmap: bool = False
    heatmap_batch: int = 0
    heatmap_head: int = 0
    all_heads: bool = False  # every head of one batch element (--heatmap-batch), with its statistics
    # today's variants (docs/modern-attention.md)
    window: int | None = None
    softcap: float | None = None
    alibi: bool = False
    rope: bool = False
    rope_base: float | None = None
    cache: int = 0
    show_mask: bool = False
    chunk: int | None = None  # Llama 4's chunked attention
    rope_fraction: float | None = None  # partial rotary: the share of each head that turns
    rope_pairing: str | None = None  # "half-split" (LLaMA) or "interleaved" (GPT-J, Llama 4)
    temperature_tuning: bool = False  # Llama 4's per-query scale (its NoPE layers)
    floor_scale: float | None = None
    attn_scale: float | None = None
    position_bias: str | None = None  # a float tensor file added to the scores (position_bias.py)
    sinks: str | None = None  # attention sinks: "random", one logit for every head, or one per head ("1,-0.5,2")
    window_side: str = "left"  # "both": a symmetric window without a causal mask (ModernBERT's local attention)
    qk_norm: str | None = None  # "head" or "proj" (mha): RMSNorm of Q and K before RoPE


def check_options(asked: AttentionOptions, scale: float | None = None, n_kv_head: int | None = None) -> AttentionSpec:
    """Every check the shared options need before anything is loaded or computed, and the attention they ask
    for, built (and so checked) once."""
    check_numbers(asked)
    if asked.meta and (asked.check or asked.save or asked.heatmap or asked.all_heads):
        used = [name for name, on in (("--check", asked.check), ("--save", asked.save), ("--heatmap", asked.heatmap),
                                      ("--all-heads", asked.all_heads)) if on]
        raise UsageError(f"--meta computes shapes only, no numbers; drop --meta or {' and '.join(used)}")
    if (asked.k or asked.v) and not asked.q:
        raise UsageError("--k/--v need --q too (with only --q, attention is self-attention: K = V = Q)")
    if asked.pad < 0:
        raise UsageError(f"--pad {asked.pad}: the number of padded keys cannot be negative")
    spec = attention_spec(asked, scale, n_kv_head)
    for option in fields(asked):  # after the options' own checks, which say more
        value = getattr(asked, option.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{option.name.replace('_', '-')} {value}: give a finite number")
    if asked.save:
        from attnscope.tensors import check_writable

        check_writable(asked.save, asked.force)
    return spec


def check_numbers(asked: Any, texts: tuple[str, ...] = ()) -> None:
    """Every option of a run's options dataclass, today's and tomorrow's: an empty file name, or an integer
    beyond PyTorch's 64 bits (a ValueError or a C++ backtrace out of torch), refused in one line. `texts`
    are the string options that are no file names (trace's target and --init)."""
    for option in fields(asked):
        value = getattr(asked, option.name)
        flag = "--" + option.name.replace("_", "-")
        if value == "" and option.name not in texts:
            raise UsageError(f"{flag} '': an empty file name; give a file, or leave {flag} out")
        if isinstance(value, int) and not -INT64 <= value < INT64:
            raise UsageError(f"{flag} {value}: out of range; PyTorch takes 64-bit integers (-2^63 to 2^63 - 1)")


def attention_spec(asked: AttentionOptions, scale: float | None, n_kv_head: int | None) -> AttentionSpec:
    """The attention the options ask for."""
    from attnscope.spec import AttentionSpec

    parse_sinks(asked.sinks)  # refused before anything runs when it is neither random nor numbers
    return AttentionSpec.asked(asked.causal, asked.window, asked.cache, alibi=asked.alibi, softcap=asked.softcap,
                      rope=rope_of(asked), scale=scale, n_kv_head=n_kv_head, chunk=asked.chunk,
                      temperature=temperature_of(asked), window_side=asked.window_side,
                      sinks=asked.sinks is not None, qk_norm=asked.qk_norm)


def parse_sinks(text: str | None) -> list[float] | None:
    """--sinks: None for `random` (or no --sinks), else the numbers given: one for every head, or one per head."""
    if text is None or text.strip().lower() == "random":
        return None
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) for v in values):
        raise UsageError(f"--sinks {text!r}: give random, one finite number for every head (--sinks 0.5), or one per "
                         "head separated by commas (--sinks 0.5,-1,2,0)")
    return values


def rope_of(asked: Any) -> Rope | None:
    """RoPE as --rope and --rope-base ask (LLaMA's base 10000 unless said otherwise); None without --rope. Any
    options with `rope` and `rope_base` (trace's have no --rope-fraction or --rope-pairing: half-split, whole)."""
    fraction, pairing = getattr(asked, "rope_fraction", None), getattr(asked, "rope_pairing", None)
    for flag, given in (("--rope-base", asked.rope_base is not None), ("--rope-fraction", fraction is not None),
                        ("--rope-pairing", pairing is not None)):
        if given and not asked.rope:
            raise UsageError(f"{flag} sets how RoPE turns Q and K; add --rope to rotate them")
    if asked.rope_base is not None and not (math.isfinite(asked.rope_base) and asked.rope_base > 1):
        raise UsageError(f"--rope-base {asked.rope_base:g} must be a number above 1 (LLaMA uses 10000 or 500000)")
    if fraction is not None and not (math.isfinite(fraction) and 0 < fraction <= 1):
        raise UsageError(f"--rope-fraction {fraction:g} must be in (0, 1]: the share of each head that rotates "
                         "(Phi-3 mini uses 1, Phi-4 mini 0.75, GPT-NeoX 0.25)")
    if not asked.rope:
        return None
    from attnscope.variants.rope import Rope

    return Rope(ROPE_BASE if asked.rope_base is None else asked.rope_base, partial_rotary_factor=fraction,
                pairing=pairing or "half-split")


def temperature_of(asked: AttentionOptions) -> TemperatureTuning | None:
    """Llama 4's temperature tuning as --temperature-tuning, --floor-scale and --attn-scale ask (Llama 4's
    8192 and 0.1 unless said otherwise); None without --temperature-tuning."""
    for flag, given in (("--floor-scale", asked.floor_scale is not None),
                        ("--attn-scale", asked.attn_scale is not None)):
        if given and not asked.temperature_tuning:
            raise UsageError(f"{flag} sets Llama 4's temperature tuning; add --temperature-tuning to scale the queries")
    if not asked.temperature_tuning:
        return None
    from attnscope.variants.temperature import TemperatureTuning

    defaults = TemperatureTuning()
    return TemperatureTuning(defaults.floor_scale if asked.floor_scale is None else asked.floor_scale,
                             defaults.attn_scale if asked.attn_scale is None else asked.attn_scale)


def check_rope_width(spec: AttentionSpec, d_head: int, name: str) -> None:
    """--rope-fraction of a head of `d_head` (named `name`: d_K, d_head) must turn at least one pair."""
    rope = spec.rope
    if rope is not None and d_head and rope.fraction != 1 and int(d_head * rope.fraction) < 1:
        raise UsageError(f"--rope-fraction {rope.fraction:g} of {name} {d_head} rotates no coordinate "
                         f"(int({rope.fraction:g} · {d_head}) = 0); raise it")


def check_cache_sizes(n_Q: int, n_K: int, cache: int) -> None:
    """With --cache the keys are the cached positions and the new ones, so --nk has one possible value."""
    if cache and n_K != cache + n_Q:
        raise UsageError(f"with --cache {cache} the keys are the {cache} cached positions plus the {n_Q} new ones: "
                         f"n_K = {cache + n_Q}, not {n_K}; drop --nk or make it {cache + n_Q}")


def check_heads(d_feat: int, heads: int, from_file: bool, d_head: int | None = None,
                has_d_head: bool = True) -> None:
    """d_head = d_feat / n_head must be whole unless --d-head gives it; name both numbers and the nearest head
    counts that divide (and --d-head where the command has it: bench has not)."""
    if d_head is None and d_feat % heads:
        near = " or ".join(f"--heads {h}" for h in divisors_near(d_feat, heads))
        source = f"the inputs' d_feat {d_feat}" if from_file else f"--d-feat {d_feat}"
        raise UsageError(f"{source} is not divisible by --heads {heads} (d_head = d_feat / n_head must be whole); "
                         f"try {near}{', or give --d-head' if has_d_head else ''}")
