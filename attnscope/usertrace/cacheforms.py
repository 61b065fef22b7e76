"""A decode step's cache in the forms code takes it besides one `(k, v)` pair in one parameter.

- Two parameters, the keys and the values apart: `forward(x, past_key=None, past_value=None)`, `k_cache, v_cache`
  (a cache word, `past`, `cache`, `prev`, ..., beside a key or value word): each gets its tensor, in the layout the
  code keeps (cachelayouts.py), the keys to the one named for keys.
- A dict: `cache["k"]`, `layer_past.get("key")`. The pair is handed as a tuple that also answers a key that names
  keys or values (`k`, `key`, `past_key`, `keys` / `v`, `value`, ...), so code that indexes it by position runs as it
  did and code that reads it by key gets the same tensors; the keys it read are noted (`Handed.asked`).
"""

from __future__ import annotations

import re
from typing import Any

CACHE_WORDS = ("cache", "cached", "past", "prev", "previous", "old", "kvcache")
KEY_WORDS = ("k", "key", "keys")
VALUE_WORDS = ("v", "value", "values", "val", "vals")


def name_words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()) if w]


def role(name: str) -> int | None:
    """0 where `name` says keys (`k`, `key`, `past_key`, `cache_k`), 1 values, None neither or both."""
    words = name_words(name)
    keys, values = any(w in KEY_WORDS for w in words), any(w in VALUE_WORDS for w in words)
    return None if keys == values else 0 if keys else 1


def is_half(name: str) -> bool:
    """`name` holds a cache of keys or of values alone: a cache word beside a key or value word (`past_key`,
    `k_cache`, `cache_v`, `prev_value`), or `kcache` / `vcache`."""
    words = name_words(name)
    if any(w in ("kcache", "vcache") for w in words):
        return True
    return any(w in CACHE_WORDS for w in words) and role(name) is not None


def pair(names: list[str]) -> tuple[str, str] | None:
    """The two parameters holding a cache's keys and values apart (keys first), where `names` holds exactly one
    of each; None otherwise."""
    halves = [n for n in names if is_half(n)]
    keys = [n for n in halves if _role(n) == 0]
    values = [n for n in halves if _role(n) == 1]
    return (keys[0], values[0]) if len(keys) == 1 and len(values) == 1 else None


def _role(name: str) -> int | None:
    words = name_words(name)
    if "kcache" in words:
        return 0
    if "vcache" in words:
        return 1
    return role(name)


class Handed(tuple):  # type: ignore[type-arg]
    """The pair `(K_cache, V_cache)` that also answers a dict's keys: `cache["k"]`, `cache.get("value")`, `"k" in
    cache`; `asked` keeps the keys the code read, in order."""

    asked: list[str]

    def __new__(cls, keys: Any, values: Any) -> Handed:
        made = super().__new__(cls, (keys, values))
        made.asked = []
        return made

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str):
            which = role(index)
            if which is None:
                raise KeyError(index)
            if index not in self.asked:
                self.asked.append(index)
            return super().__getitem__(which)
        return super().__getitem__(index)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if isinstance(key, str) and role(key) is not None else default

    def __contains__(self, item: object) -> bool:
        if isinstance(item, str):
            return role(item) is not None
        return any(item is part for part in self)


Handed.__name__ = Handed.__qualname__ = "tuple"  # what the code was handed, in its errors: "... but got tuple"


def note(parameters: tuple[str, ...], asked: list[str], layout_words: str) -> str | None:
    """How the code took its cache, where not as one pair: two parameters, or a dict's keys; `layout_words`: its
    layout, "" where a note already says it."""
    each = f", each {layout_words}" if layout_words else ""
    if len(parameters) == 2:
        return (f"{parameters[0]}, {parameters[1]}: your code takes its cache as two parameters, the keys and the "
                f"values apart{each}; the keys to {parameters[0]}, the values to {parameters[1]}. "
                "A convention, not a mistake: the reference reads the same keys and values")
    if not asked:
        return None
    read = " and ".join(f"{parameters[0]}[{key!r}]" for key in asked)
    return (f"{parameters[0]}: your code reads its cache as a dict, {read}{each}; it is handed "
            "one that answers those keys with the keys and the values. A convention, not a mistake: the reference "
            "reads the same keys and values")
