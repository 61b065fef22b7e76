"""What a module declares of its attention, read in one place: its RoPE base (`rope_theta`), the share of each head
RoPE turns (`rotary_pct`, `partial_rotary_factor`), the scores' softcap (Gemma 2's `attn_logit_softcapping`, C ·
tanh(scores / C) before the mask), DBRX's `clip_qkv` (q, k and v clipped to ±c) and the scores' scale (Gemma 2's
`query_pre_attn_scalar` q, scale q^-0.5; Granite's `attention_multiplier` and Grok-1's `attn_output_multiplier`, the
scale itself). Each is read from the module, its submodules, a config it keeps (an object or a dict, one level
down), or the arguments its __init__ was given and did not keep (gpt-fast's `def __init__(self, config): self.n_head
= config.n_head`, built from --init's `config=ModelArgs(...)`, and the defaults of its parameters --init does not
set, runs/trace_setup._init_defaults): `holders` walks them all, so every value is looked
for in the same places.

The module's own value is the reference's: code that computes another (caps nothing, scales by 1/√d_head where
its config says query_pre_attn_scalar, rotates with another base) has a bug, named by experiment (experiments.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnscope.usertrace.reference import Spec

# Where a module keeps its RoPE base: on itself, a rotary submodule (`RotaryEmbedding(base=...)`) or a config
BASE_NAMES = ("rope_theta", "rope_base", "rotary_base", "rotary_emb_base", "rope_freq_base", "theta", "base")
# Where a module's config says the share of each head RoPE turns: a width (GPT-J's rotary_dim, GPT-NeoX's
# rotary_ndims) or a fraction (transformers' partial_rotary_factor, Pythia's rotary_pct, flash-attn's
# rotary_emb_fraction)
WIDTH_NAMES = ("rotary_dim", "rotary_ndims", "rotary_emb_dim", "rope_dim", "rotary_dims")
FRACTION_NAMES = ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction", "rotary_fraction", "rope_fraction")
SCALING_NAMES = ("rope_scaling", "rope_parameters")  # transformers' 4.x and 5.x names for a RoPE scaling's dict
SOFTCAP_NAMES = ("attn_logit_softcapping", "attn_logit_softcap", "attention_logit_softcapping", "attn_softcapping",
                 "attn_softcap", "attention_softcap", "logits_soft_cap", "softcap")
DECLARED_CLIP = "q, k and v clipped to "  # how the note of a clip the config says begins
# where a config says that q, k and v are clipped to ±c after their projection (DBRX's attn_config.clip_qkv)
CLIP_NAMES = ("clip_qkv", "qkv_clip", "clamp_qkv", "qkv_clamp")
# a config's name for the scale, and the scale it gives
SCALE_NAMES: dict[str, tuple[Callable[[float], float], str]] = {
    "query_pre_attn_scalar": (lambda q: q ** -0.5, "query_pre_attn_scalar^-0.5"),
    "attention_multiplier": (lambda m: m, "attention_multiplier"),
    "attn_output_multiplier": (lambda m: m, "attn_output_multiplier"),  # Grok-1's logits · multiplier (xai-org)
}


def holders(module: Any, built_with: dict[str, Any] | None = None) -> Iterator[tuple[bool, dict[str, Any]]]:
    """Every place the module may declare a value, each with whether it is a config: the attributes of the module
    and of each submodule (False), the objects and dicts they hold one level down (True), and the arguments it was
    built with (`built_with`, runs/trace._built_with: a config its __init__ read and did not keep) with what they
    hold one level down (True)."""
    for in_config, _, held in _labelled(module, built_with):
        yield in_config, held


def _labelled(module: Any, built_with: dict[str, Any] | None) -> Iterator[tuple[bool, str, dict[str, Any]]]:
    """holders' places, each with how the module reaches it (`self.config`, `self.rotary_emb`, `config` its
    __init__ was given, `self.config.rope_parameters`): where a value was read, in words."""
    if module is None or not isinstance(module, torch.nn.Module):
        return
    places = [(False, "self" + (f".{name}" if name else ""), vars(sub)) for name, sub in module.named_modules()]
    for in_config, at, held_by in places + [(True, "", built_with or {})]:
        yield in_config, at, held_by
        for key, v in held_by.items():
            if not (isinstance(v, dict) or (hasattr(v, "__dict__") and not isinstance(v, (torch.Tensor, type))
                                            and not callable(v))):
                continue
            held = v if isinstance(v, dict) else vars(v)
            inner = f"{at}.{key}" if at else key
            yield True, inner, held
            # transformers 5 keeps a config's rope_theta and partial_rotary_factor in its rope_parameters (4.x's
            # rope_scaling): a flat dict of them is the config's too; one dict per layer type (Gemma 3's) says none
            yield from ((True, f"{inner}.{name}", rope) for name, rope in ((n, held.get(n)) for n in SCALING_NAMES)
                        if isinstance(rope, dict) and not any(isinstance(x, dict) for x in rope.values()))


def _numbers(module: Any, names: tuple[str, ...], built_with: dict[str, Any] | None,
             above: float = 0) -> Iterator[tuple[bool, str, float]]:
    """(in a config, name, value) of each number above `above` the module declares under one of `names`."""
    for in_config, held in holders(module, built_with):
        for name in names:
            value = held.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > above:
                yield in_config, name, float(value)


def own_base(module: Any, built_with: dict[str, Any] | None = None) -> float | None:
    """The RoPE base the module says it uses (a number above 1 under one of BASE_NAMES, wherever `holders` looks). A
    config's name (`rope_theta`) outranks a generic one (a rotary submodule's `base`), which may be a default the
    config's value never reached; under one name, a config's value outranks the module's own attribute, which its
    code may have set otherwise (base_disagreement says so). None where none says one, or where two configs (or,
    with no config, two attributes) of the same rank say different ones."""
    said = _said_base(module, built_with)
    return said[0] if said is not None else _inv_freq_base(module)


def _said_base(module: Any, built_with: dict[str, Any] | None) -> tuple[float, str, list[str]] | None:
    """(the base, where it is said, the module's own attributes that say another) per own_base's ranking."""
    found: dict[int, dict[bool, dict[float, str]]] = {}
    for in_config, name, value in _numbers(module, BASE_NAMES, built_with, above=1):
        found.setdefault(BASE_NAMES.index(name), {}).setdefault(in_config, {}).setdefault(value, name)
    if not found:
        return None
    best = found[min(found)]
    config, own = best.get(True, {}), best.get(False, {})
    chosen = config or own
    if len(chosen) != 1:
        return None
    (value, name), = chosen.items()
    return value, name, [f"{n} = {v:g}" for v, n in own.items() if v != value] if config else []


def base_disagreement(module: Any, built_with: dict[str, Any] | None = None) -> str | None:
    """Words for a module whose own attribute says another RoPE base than its config: the config's is the
    reference's (own_base); None where they agree."""
    said = _said_base(module, built_with)
    if said is None or not said[2]:
        return None
    value, name, others = said
    return (f"your module's config says RoPE base {value:g} (its {name}) and the module itself says another (its "
            f"{', '.join(others)}): declared values that disagree; the config's, what the checkpoint was made with, "
            "is the reference's, and code that rotates with another base has a bug, named by experiment")


def base_where(module: Any, built_with: dict[str, Any] | None = None) -> str | None:
    """Where own_base read the module's RoPE base, in words: `its config's rope_theta: self.config.rope_theta`,
    `its config's rope_parameters: self.config.rope_parameters['rope_theta']`, `its attribute
    self.rotary_emb.base`, `the rope_base of the config its __init__ was given: config.rope_base`, or the inv_freq its
    rotary embedding holds; None where it says none."""
    said = _said_base(module, built_with)
    if said is None:
        return "the inv_freq its rotary embedding holds" if _inv_freq_base(module) is not None else None
    value, name, _ = said
    found = [(in_config, at) for in_config, at, held in _labelled(module, built_with)
             if isinstance(held.get(name), (int, float)) and float(held[name]) == value]
    if not found:
        return None
    in_config, at = max(found, key=lambda f: f[0])  # a config's before the module's own attribute (own_base's rank)
    where = f"{at}.{name}" if at else name
    if not in_config:
        return f"its attribute {where}"
    if not at:
        return f"the {name} its __init__ was given"
    if not at.startswith("self"):
        return f"the {name} of the {at.split('.')[0]} its __init__ was given: {where}"
    kind = next((n for n in SCALING_NAMES if at.endswith(f".{n}")), None)
    return f"its config's {kind}: {at}['{name}']" if kind else f"its config's {name}: {where}"


def _inv_freq_base(module: Any) -> float | None:
    """The base a rotary submodule's `inv_freq` buffer holds where no name says one (ModernBERT's rotary_emb, built
    from its config's global_rope_theta or local_rope_theta): `inv_freq[k] = base^(-k / m)` over its m entries, read
    only where the buffer is that geometric series from 1 (a scaled RoPE's is not); None otherwise, or where two
    differ."""
    if not isinstance(module, torch.nn.Module):
        return None
    bases = set()
    for sub in module.modules():
        inv = getattr(sub, "inv_freq", None)
        if not isinstance(inv, torch.Tensor) or inv.dim() != 1 or inv.numel() < 2 or not inv.is_floating_point():
            continue
        inv = inv.detach().double().cpu()
        m = inv.numel()
        k = torch.arange(m, dtype=torch.float64)
        if float(inv.min()) <= 0:
            return None
        base = math.exp(-m * float((k * inv.log()).sum() / (k * k).sum()))  # least squares on log inv_freq
        nice = float(f"{base:.3g}")  # float32's rounding taken off a base a config would write
        base = nice if abs(nice - base) <= 1e-4 * base else base
        if abs(float(inv[0]) - 1.0) > 1e-6 or not bool(torch.allclose(inv, base ** (-k / m), rtol=1e-4, atol=0)):
            return None
        bases.add(base)
    return next(iter(bases)) if len(bases) == 1 else None


def own_scaling(module: Any, built_with: dict[str, Any] | None = None) -> Any:
    """The RoPE the module's config declares beside its base, as attnscope's Rope (variants/rope.py): its scaling dict
    (`rope_scaling={"type": "linear", ...}`, `rope_parameters={"rope_type": "llama3", ...}`) and its
    max_position_embeddings, wherever `holders` looks, at the module's base (own_base, else 10000: replaced by the
    caller's); None where none says one, it is the default, two say different ones, or the Rope refuses them."""
    from attnscope.errors import AttnscopeError
    from attnscope.variants.rope import Rope

    found: list[dict[str, Any]] = []
    for _, held in holders(module, built_with):
        for name in SCALING_NAMES:
            value = held.get(name)
            kind = value.get("rope_type", value.get("type")) if isinstance(value, dict) else None
            if isinstance(value, dict) and isinstance(kind, str) and kind != "default" and value not in found:
                found.append(value)
    if len(found) != 1:
        return None
    longest = own_value(module, ("max_position_embeddings",), built_with)
    try:
        return Rope(own_base(module, built_with) or 10000.0, scaling=found[0],
                    max_position_embeddings=int(longest[1]) if longest is not None else None)
    except (AttnscopeError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Share:
    """The share of each head the module says RoPE turns (declared_share): `fraction` 1.0 for the whole head;
    `said`, where it is said ("its config's partial_rotary_factor = 0.5"); `overruled`, the module's own attributes
    that say another share where its config says one (the config's is the reference's), else empty."""

    fraction: float
    said: str
    overruled: tuple[str, ...] = ()

    def disagreement(self, d_head: int) -> str | None:
        """A note's words where the config and the module's attributes disagree; None where they do not."""
        if not self.overruled:
            return None
        rotated = f"the first {int(self.fraction * d_head)}" if self.fraction < 1 else "all"
        return (f"RoPE's rotated share: your module's config says {rotated} of each head's {d_head} coordinates "
                f"({self.said}) and the module itself says another ({', '.join(self.overruled)}): declared values "
                "that disagree; the config's, what the checkpoint was made with, is the reference's, and code that "
                "rotates another share has a bug, named by experiment (rope.fraction)")


def declared_share(module: Any, d_head: int | None, built_with: dict[str, Any] | None = None) -> Share | None:
    """The share of each head RoPE turns as the module says it: a width under WIDTH_NAMES over d_head, or a fraction
    under FRACTION_NAMES, wherever `holders` looks. A config's (one the module keeps, its rope_parameters, or one its
    __init__ was given) outranks the module's own attribute, which its code derives from it and normally agrees with:
    where they disagree, the config's is kept and the attribute named (Share.overruled). None where none says one,
    or where two configs (or, with no config, two attributes) disagree."""
    if not d_head:
        return None
    found: dict[bool, dict[float, list[str]]] = {True: {}, False: {}}
    for in_config, name, value in _numbers(module, (*WIDTH_NAMES, *FRACTION_NAMES), built_with):
        share = value / d_head if name in WIDTH_NAMES else value
        width = int(share * d_head)
        if share < 1 and width >= 2 and width % 2 == 0:
            share = width / d_head
        elif share >= 1:
            share = 1.0
        else:
            continue
        said = f"{name} = {int(value) if name in WIDTH_NAMES else f'{value:g}'}"
        if said not in found[in_config].setdefault(share, []):
            found[in_config][share].append(said)
    config, own = found[True], found[False]
    chosen = config or own
    if len(chosen) != 1:
        return None
    (share, names), = chosen.items()
    overruled = tuple(f"its {n}" for s, ns in own.items() if s != share for n in ns) if config else ()
    return Share(share, ("its config's " if config else "its ") + ", ".join(names), overruled)


def own_fraction(module: Any, d_head: int | None, built_with: dict[str, Any] | None = None) -> float | None:
    """The share of each head RoPE turns, where the module says it is less than all of it (declared_share); None
    where none says one, where they disagree, or where it is the whole head."""
    share = declared_share(module, d_head, built_with)
    return share.fraction if share is not None and share.fraction < 1 else None


def with_share(spec: Spec, module: Any, d_head: int | None, built_with: dict[str, Any] | None) -> Spec:
    """`spec` rotating the share of each head the module says (declared_share), as the module's own: code that rotates
    another share then has a bug, named by experiment. The whole head said alone is left to the code (a share it
    rotates is read as its convention, as where none is said); said by a config against the module's attribute,
    the whole head is the reference's."""
    share = declared_share(module, d_head, built_with)
    if share is None or (share.fraction >= 1 and not share.overruled):
        return spec
    return replace(spec, rope_fraction=share.fraction if share.fraction < 1 else None, fraction_from_module=True)


def own_value(module: Any, names: tuple[str, ...] | list[str],
              built_with: dict[str, Any] | None = None) -> tuple[str, float] | None:
    """The positive number the module says under one of `names` (the first name that holds one wins), with the
    name; None where none says one, or two holders of that name say different ones. A config's value (an object or
    a dict the module keeps, or the arguments it was built with) outranks the module's own attribute, which its code
    may have copied wrongly (Gemma 2's `self.attn_logit_softcapping = config.attn_logit_softcapping`)."""
    found: dict[tuple[bool, str], set[float]] = {}
    for in_config, name, value in _numbers(module, tuple(names), built_with):
        found.setdefault((in_config, name), set()).add(value)
    for key in [(True, name) for name in names] + [(False, name) for name in names]:
        if key in found:
            values = found[key]
            return (key[1], next(iter(values))) if len(values) == 1 else None
    return None


def _disagreeing(module: Any, name: str, value: float, built_with: dict[str, Any] | None) -> str:
    """Words for the module's own attributes under `name` that say another value than its config's `value`
    (own_value's choice, which then is the config's); empty where none does."""
    others = sorted({v for in_config, _, v in _numbers(module, (name,), built_with) if not in_config and v != value})
    if not others:
        return ""
    return (f"; the module itself says another (its {', '.join(f'{name} = {v:g}' for v in others)}): declared values "
            "that disagree, and the config's, what the checkpoint was made with, is the reference's")


def with_declared(module: Any, spec: Spec) -> tuple[Spec, list[str]]:
    """`spec` with the softcap and the scale the module declares (or the config its __init__ was given,
    `spec.built_with`), where the options said none; with a note for each one read."""
    notes = []
    if spec.softcap is None and not spec.softcap_asked:
        cap = own_value(module, SOFTCAP_NAMES, spec.built_with)
        if cap is not None:
            name, value = cap
            spec = replace(spec, softcap=value, softcap_from_module=True)
            notes.append(f"softcap {value:g}, read from your module (its {name}): the reference caps the scores, "
                         f"{value:g} · tanh(scores / {value:g}), before the mask; --softcap overrides it"
                         + _disagreeing(module, name, value, spec.built_with))
    if spec.scale is None and spec.layout != "col":
        said = own_value(module, list(SCALE_NAMES), spec.built_with)
        if said is not None and _made_a_width(module, said[0]):
            said = None  # Jukebox's attention_multiplier: a width's factor, `int(config.attention_multiplier * ...)`
        if said is not None:
            name, value = said
            to_scale, how = SCALE_NAMES[name]
            scale = to_scale(value)
            spec = replace(spec, scale=scale, scale_from=f"{how} = {scale:.6g} (your module's {name} = {value:g})")
            notes.append(f"scale {scale:.6g} = {how}, read from your module (its {name} = {value:g}); --scale "
                         "overrides it" + _disagreeing(module, name, value, spec.built_with))
    if spec.clip_qkv is None:
        clip = own_value(module, CLIP_NAMES, spec.built_with)
        if clip is not None:
            name, value = clip
            spec = replace(spec, clip_qkv=(-value, value))
            notes.append(f"{DECLARED_CLIP}±{value:g} after their projection, read from your module (its "
                         f"{name} = {value:g}, DBRX's): the reference clips its Q_feat, K_feat and V_feat so"
                         + _disagreeing(module, name, value, spec.built_with))
    return spec, notes


WIDTH_CALLS = frozenset({"int", "round", "floor", "ceil"})  # what turns a product into a count of features


def _made_a_width(module: Any, name: str) -> bool:
    """Whether the code of the module (or of a submodule) turns the value under `name` into a width, as a factor
    inside `int(...)`, `round(...)`, `math.floor`/`ceil` (Jukebox's `hidden_dim = int(config.attention_multiplier *
    self.embed_dim)`, the projections' width, where Granite's same name is the scores' scale): then no scale."""
    import ast

    from attnscope.usertrace.astreads import called, source_tree

    seen: set[type] = set()
    for sub in module.modules() if isinstance(module, torch.nn.Module) else ():
        for cls in type(sub).__mro__:
            if cls in seen or cls.__module__.split(".")[0] == "torch" or cls is object:
                continue
            seen.add(cls)
            tree = source_tree(cls)
            for call in ast.walk(tree) if tree is not None else ():
                if isinstance(call, ast.Call) and called(call) in WIDTH_CALLS and any(
                        (isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name)
                        for arg in call.args for n in ast.walk(arg)):
                    return True
    return False
