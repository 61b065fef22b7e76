"""config.json, read defensively: every number a family needs is checked as it is read, so a malformed
config (a missing key, a string for a number, a list instead of an object, 0 heads) is one line saying
which key is wrong and what it should be, never a KeyError or a ZeroDivisionError later.

`Config.int("num_attention_heads", "n_head")` takes the first of its names that is present: families and
transformers versions spell some keys differently (GPT-2's `n_head`, LLaMA's `num_attention_heads`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attnscope.errors import UsageError

_MISSING = object()


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
        return UsageError(f"{self.path}: {shown} {what}; fix config.json or save the model again with save_pretrained")


def read_config(folder: Path) -> Config:
    path = folder / "config.json"
    if not path.is_file():
        raise UsageError(f"{{model}} {folder}: no config.json in that folder; give a folder saved by save_pretrained",
                         "model")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not readable JSON ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} holds a JSON {type(data).__name__}, not an object of settings; "
                         "give the config.json that save_pretrained wrote")
    return Config(path, data)
