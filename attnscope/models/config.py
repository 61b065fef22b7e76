"""config.json, read defensively: every number a family needs is checked as it is read, so a malformed
config (a missing key, a string for a number, a list instead of an object, 0 heads) is one line saying
which key is wrong and what it should be, never a KeyError or a ZeroDivisionError later.

`Config.int("num_attention_heads", "n_head")` takes the first of its names that is present: families and
transformers versions spell some keys differently (GPT-2's `n_head`, LLaMA's `num_attention_heads`).

Before any of that, `read_config` refuses what no model has, from the file alone and wherever it sits (a
`text_config` too): JSON nested past `MAX_DEPTH`, a size past `LIMITS` (10**12 layers would hang a loop over
the layers, 10**30 heads would allocate gigabytes) or any integer past 64 bits. Every family and the
families traced through transformers read their config through here, so all of them get these bounds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attnscope.errors import UsageError

_MISSING = object()

# What config.json's sizes can be, at most: far past any model there is (the deepest have ~200 layers, the
# widest ~50k features, the largest vocabularies ~1M tokens), and small enough that a loop over them or a
# tensor of them stays cheap. (what a value past the bound would mean, the bound, the keys, as families and
# transformers versions spell them)
LIMITS = (
    ("no model has that many layers", 100_000,
     ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "decoder_layers",
      "encoder_layers")),
    ("no model has that many heads", 65_536,
     ("num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_head_kv",
      "multi_query_group_num", "encoder_attention_heads", "decoder_attention_heads")),
    ("no model is that wide", 1 << 20,
     ("hidden_size", "n_embd", "d_model", "head_dim", "intermediate_size", "n_inner", "ffn_dim", "d_ff", "d_kv",
      "encoder_ffn_dim", "decoder_ffn_dim", "kv_lora_rank", "q_lora_rank", "moe_intermediate_size",
      "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")),
    ("no vocabulary is that large", 1 << 24, ("vocab_size",)),
    ("no model has that many experts", 65_536, ("num_local_experts", "n_routed_experts", "num_experts")),
)
LIMIT_OF = {key: (what, bound) for what, bound, keys in LIMITS for key in keys}
INT64 = 2**63  # torch's integers: a larger one would overflow inside PyTorch
MAX_DEPTH = 64  # save_pretrained nests a few levels (text_config.rope_scaling); JSON nested deeper is damaged


INT64_MAX = 2 ** 63 - 1

class Config:
    """The parsed config.json of a model folder, with typed getters that refuse bad values in one line."""

    def __init__(self, path: Path, data: Mapping[str, Any]) -> None:
        self.path = path
        self.data = data

    @property
    def model_type(self) -> str:
        value = self.data.get("model_type")
        return value if isinstance(value, str) and value else "?"

    @property
    def architecture(self) -> str:
        names = self.data.get("architectures")
        if isinstance(names, list) and names and isinstance(names[0], str):
            return names[0]
        return f"model_type {self.model_type}"

    def has(self, *names: str) -> bool:
        return any(self.data.get(name) is not None for name in names)

    def raw(self, *names: str, default: Any = None) -> Any:
        """The first of `names` present and not null, else `default`."""
        for name in names:
            if self.data.get(name) is not None:
                return self.data[name]
        return default

    def integer(self, *names: str, default: Any = _MISSING, minimum: int = 1) -> int:
        """A whole number of at least `minimum` (bools and strings refused)."""
        value = self.raw(*names)
        if value is None:
            if default is _MISSING:
                raise self._error(names, "is missing; it must be a whole number")
            return int(default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._error(names, f"is {value!r} ({type(value).__name__}); it must be a whole number")
        if value < minimum:
            raise self._error(names, f"is {value}; it must be at least {minimum}")
        if value > INT64_MAX:  # 1e308 is a whole float; no size, count or position of a model is this large
            raise self._error(names, f"is {value:.3g}; it must be at most 2**63 - 1, the largest torch's int64 holds")
        return value

    def number(self, *names: str, default: Any = _MISSING, positive: bool = True) -> float:
        value = self.raw(*names)
        if value is None:
            if default is _MISSING:
                raise self._error(names, "is missing; it must be a number")
            return float(default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._error(names, f"is {value!r}; it must be a finite number")
        if positive and value <= 0:
            raise self._error(names, f"is {value}; it must be positive")
        return float(value)

    def optional_number(self, *names: str) -> float | None:
        return None if self.raw(*names) is None else self.number(*names)

    def optional_integer(self, *names: str, minimum: int = 1) -> int | None:
        return None if self.raw(*names) is None else self.integer(*names, minimum=minimum)

    def flag(self, *names: str, default: bool = False) -> bool:
        """A true/false field; `default` where it is absent. One written as null is false, as transformers reads it:
        the config keeps the None and the modeling code tests it (`if self.config.rope_interleave:`), so a null
        DeepSeek-V3 `rope_interleave`, whose default is true, rotates half-split (a long fuzz run found --check
        failing where attnscope read the null as the default)."""
        if not self.has(*names) and any(name in self.data for name in names):
            return False
        value = self.raw(*names, default=default)
        if not isinstance(value, bool):
            raise self._error(names, f"is {value!r}; it must be true or false")
        return value

    def string(self, *names: str, default: str | None = None) -> str:
        value = self.raw(*names, default=default)
        if not isinstance(value, str):
            raise self._error(names, f"is {value!r}; it must be a string")
        return value

    def mapping(self, *names: str) -> Mapping[str, Any] | None:
        value = self.raw(*names)
        if value is not None and not isinstance(value, Mapping):
            raise self._error(names, f"is {value!r}; it must be an object")
        return value

    def str_list(self, name: str, length: int) -> list[str] | None:
        """A list of `length` strings (e.g. `layer_types`, one per layer), or None when absent."""
        value = self.raw(name)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or len(value) != length:
            raise self._error((name,), f"must be a list of {length} strings, one per layer")
        return value

    def _error(self, names: tuple[str, ...], what: str) -> UsageError:
        shown = names[0] if len(names) == 1 else f"{names[0]} (or {', '.join(names[1:])})"
        return UsageError(f"{self.path}: {shown} {what}; {fix_advice(self.path)}")


def fix_advice(path: Path) -> str:
    """What to do about a bad setting: a folder's config.json is fixed or saved again, a GGUF file's settings are
    its metadata (models/gguf/config.py reads them under config.json's names), so the file is the thing to fix."""
    from attnscope.models.source import source_of

    return source_of(path).fix_advice


def layer_entry(table: Mapping[str, Any], index: int) -> Any:
    """`per_layer_config`'s entry for layer `index`: its keys are layer numbers, written zero-padded to the width of
    the largest ("05" of 30 layers) by transformers' config serialisation."""
    found = {int(key): value for key, value in table.items() if str(key).isdigit()}
    return found.get(index) or {}


def read_config(folder: Path) -> Config:
    """The model's settings, as its source holds them (models/source.py): a folder's config.json, a GGUF file's
    metadata under config.json's names; refused in one line past what any model has (`check_sane`)."""
    from attnscope.models.source import source_of

    path, data = source_of(folder).settings()
    check_sane(path, data)
    return Config(path, data)


def check_sane(path: Path, data: Any) -> None:
    """Refuse nesting past MAX_DEPTH, a size past LIMITS and an integer past 64 bits, wherever they sit in `data`
    (one pass, no recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise UsageError(f"{path}: malformed: JSON nested more than {MAX_DEPTH} deep; no model's settings are")
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
            elif isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item):
                _check_number(path, key, item)


def _check_number(path: Path, key: object, value: float) -> None:
    """A size past its bound (as an integer or a float, which Config.integer accepts when whole), or any other
    integer past 64 bits (floats such as rope_theta may be large)."""
    what, bound = LIMIT_OF.get(key, ("", INT64 - 1)) if isinstance(key, str) else ("", INT64 - 1)
    if abs(value) <= bound or (not what and isinstance(value, float)):
        return
    shown = f"{value:.3g}" if isinstance(value, float) or abs(value) >= 10**15 else f"{value:,}"
    if what:
        raise UsageError(f"{path}: {key} is {shown}; {what} (attnscope takes at most {bound:,}); {fix_advice(path)}")
    raise UsageError(f"{path}: {key} is {shown}, beyond 64-bit integers; {fix_advice(path)}")
