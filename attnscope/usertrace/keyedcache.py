"""A decode step's cache as a dict the code reads by keys of its own: HF XLM's `cache`, `{"slen": n_cached,
layer_id: (k, v)}`, read as `klen = cache["slen"] + qlen`, `if self.layer_id in cache: k_, v_ =
cache[self.layer_id]` and written back `cache[self.layer_id] = (k, v)` (fairseq's incremental state keyed by a
module's own id is the same habit).

Code that raises on the pair `(K_cache, V_cache)` (a KeyError on a key the pair cannot answer, a tuple given a
key) is handed a dict that answers, from the keys the code itself reads:

- a key naming keys or values (`k`, `past_value`: cacheforms.role): that tensor;
- a key that is the value of one of the module's own index attributes (`self.layer_id`, `self.layer_idx`, an int
  under a `layer`, `id`, `idx` or `index` word): that layer's pair `(K_cache, V_cache)`, in the layout tried;
- a word that says a length or a position (`slen`, `seq_len`, `offset`, `n_cached`, `start_pos`): the number of
  cached positions, n_cache;

and raises KeyError on any other key, which is kept (`unanswered`) so that trace can say in one line what it could
not feed. What the code writes (`cache[layer_id] = (k, v)`) is kept apart (`written`), never read back: trace calls
the code many times with the same inputs, and every call starts from the same cache (hfcache.py's never grows either).
"""

from __future__ import annotations

from typing import Any

from attnscope.usertrace.cacheforms import name_words, role

PREFIX = "dict·"  # cachelayouts' layout prefix: the pair, laid out as the base layout, in such a dict
LENGTH_WORDS = ("len", "length", "slen", "seqlen", "klen", "offset", "pos", "position", "positions", "start",
                "cached", "count", "size", "step", "steps", "seen", "cur", "num", "total", "tokens")
INDEX_WORDS = ("layer", "id", "idx", "index")


def says_length(key: str) -> bool:
    """Whether a key's words say a count of positions (`slen`, `seq_len`, `n_cached`, `start_pos`), not a tensor."""
    words = name_words(key)
    return any(w in LENGTH_WORDS or w.endswith("len") for w in words) and role(key) is None


def slots(module: Any) -> dict[int, str]:
    """{value: attribute} of the module's (and its submodules') int attributes named as an index (`layer_id`,
    `layer_idx`): the keys a dict cache may hold its layer's pair under."""
    import torch

    found: dict[int, str] = {}
    parts = list(module.modules()) if isinstance(module, torch.nn.Module) else [module] if module is not None else []
    for part in parts:
        for name, value in vars(part).items():
            if isinstance(value, int) and not isinstance(value, bool) and any(
                    w in INDEX_WORDS for w in name_words(name)):
                found.setdefault(value, name)
    return found


class Keyed(dict):  # type: ignore[type-arg]
    """A dict answering the keys the code reads (the module docstring's rules); `asked` keeps the keys it answered,
    in order, `unanswered` those it could not."""

    def __init__(self, parts: tuple[Any, Any], n_cache: int, layer_slots: dict[int, str]) -> None:
        super().__init__()
        self.parts, self.n_cache, self.layer_slots = parts, n_cache, layer_slots
        self.asked: list[Any] = []
        self.unanswered: list[Any] = []
        self.written: dict[Any, Any] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        self.written[key] = value

    def _answer(self, key: Any) -> tuple[bool, Any]:
        if isinstance(key, str):
            which = role(key)
            if which is not None:
                return True, self.parts[which]
            return (True, self.n_cache) if says_length(key) else (False, None)
        if isinstance(key, int) and not isinstance(key, bool) and key in self.layer_slots:
            return True, tuple(self.parts)
        return False, None

    def _read(self, key: Any) -> tuple[bool, Any]:
        found, value = self._answer(key)
        if found and key not in self.asked:
            self.asked.append(key)
        elif not found and key not in self.unanswered:
            self.unanswered.append(key)
        return found, value

    def __missing__(self, key: Any) -> Any:
        found, value = self._read(key)
        if not found:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or self._read(key)[0]

    def get(self, key: Any, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        found, value = self._read(key)
        return value if found else default


Keyed.__name__ = Keyed.__qualname__ = "dict"  # what the code was handed, in its errors


def words(parameter: str, asked: list[Any], layer_slots: dict[int, str]) -> str:
    """The note of a dict cache the code ran on: each key it read and what it got."""
    said = []
    for key in asked:
        if isinstance(key, str):
            which = role(key)
            said.append(f"{parameter}[{key!r}] the cached {'keys' if which == 0 else 'values'}" if which is not None
                        else f"{parameter}[{key!r}] the number of cached positions")
        else:
            said.append(f"{parameter}[{key}] (your module's {layer_slots.get(key, 'index')}) the pair (K_cache, "
                        "V_cache)")
    return (f"{parameter}: your code reads its cache as a dict keyed its own way, {', '.join(said)}; it is handed "
            "one that holds them. A convention, not a mistake: the reference reads the same keys and values")


def unfed(parameter: str, keys: list[Any]) -> str:
    """One line for a dict cache whose keys trace could not answer."""
    shown = ", ".join(f"{parameter}[{k!r}]" for k in keys)
    return (f"--cache: your code reads {shown} from its cache, which trace cannot feed: it answers a key naming keys "
            "or values, a key that is your module's own layer index (an int attribute such as layer_id) with that "
            "layer's (keys, values), and a key naming a length or a position (slen, offset) with the number of "
            "cached positions")
