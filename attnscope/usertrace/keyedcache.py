"""A decode step's cache as a dict the code reads by keys of its own: HF XLM's `cache`, `{"slen": n_cached,
layer_id: (k, v)}`, read as `klen = cache["slen"] + qlen`, `if self.layer_id in cache: k_, v_ =
cache[self.layer_id]` and written back `cache[self.layer_id] = (k, v)`; fairseq's incremental state, a dict under a
key of the module's own (`incremental_state[self._state_key]`) holding `{"prev_key": .., "prev_value": ..}`.

Code that raises on the pair `(K_cache, V_cache)` (a KeyError on a key the pair cannot answer, a tuple given a
key) is handed a dict that answers, from the keys the code itself reads and what it does with what it gets:

- a key naming keys or values (`k`, `past_value`, `prev_key`: cacheforms.role): that tensor;
- a key that is the value of one of the module's own index attributes (`self.layer_id`, `self.layer_idx`, an int
  under a `layer`, `id`, `idx` or `index` word): that layer's pair `(K_cache, V_cache)`, in the layout tried;
- any other word (`slen`, `n_past`, `cur_len`, `t`, `attn_state`): a `Probe`, the number of cached positions,
  n_cache, as an int that notes what the code does with it: taken as a number (added to positions, compared,
  used to slice), it is the cached length; read by keys (`saved["prev_key"]`), it is a dict of its own that answers
  them as the cache does. No name is read for a length: the code's use says it.

A key naming a mask or a padding (fairseq's `prev_key_padding_mask`) is none the cache holds. Any other key raises
KeyError and is kept (`unanswered`), as is a probe the code neither took as a number nor read by keys where its run
failed, so that trace can say in one line what it could not feed. What the code writes (`cache[layer_id] = (k,
v)`) is kept apart (`written`), never read back: trace calls the code many times with the same inputs, and every
call starts from the same cache (hfcache.py's never grows either).
"""

from __future__ import annotations

from typing import Any

from attnscope.usertrace.cacheforms import name_words, role

PREFIX = "dict·"  # cachelayouts' layout prefix: the pair, laid out as the base layout, in such a dict
INDEX_WORDS = ("layer", "id", "idx", "index")
NOT_HELD = ("mask", "padding", "pad")  # a key naming one of these holds none of the cache (prev_key_padding_mask)


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


class Answering:
    """The answers of a dict cache and of the dicts nested in it (the module docstring's rules); `asked` keeps the
    keys answered, in order, `unanswered` those it could not, `written` what the code wrote."""

    parts: tuple[Any, Any]
    n_cache: int
    layer_slots: dict[int, str]
    asked: list[Any]
    unanswered: list[Any]
    written: dict[Any, Any]
    probes: dict[Any, Probe]

    def _start(self, parts: tuple[Any, Any], n_cache: int, layer_slots: dict[int, str]) -> None:
        self.parts, self.n_cache, self.layer_slots = parts, n_cache, layer_slots
        self.asked, self.unanswered, self.written, self.probes = [], [], {}, {}

    def _answer(self, key: Any) -> tuple[bool, Any]:
        if isinstance(key, str):
            if any(w in NOT_HELD for w in name_words(key)):
                return False, None
            which = role(key)
            if which is not None:
                return True, self.parts[which]
            if key not in self.probes:
                self.probes[key] = Probe(self.n_cache, self.parts)
            return True, self.probes[key]
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

    def unfed(self, probes: bool = True) -> list[tuple[Any, ...]]:
        """The keys the code read that nothing answered as it used them, each as its path of keys: those it could
        not answer, and (`probes`: where the code raised on an int) probes it neither took as a number nor read by
        keys; and those of the dicts nested in it."""
        out = [(key,) for key in self.unanswered]
        for key, probe in self.probes.items():
            if probes and not probe.as_number and not probe.asked:
                out.append((key,))
            out += [(key, *inner) for inner in probe.unfed(probes)]
        return out

    def said(self, parameter: str) -> list[str]:
        """What each key the code read got, in words (`cache['n_past'] the number of cached positions`)."""
        out = []
        for key in self.asked:
            probe = self.probes.get(key)
            if probe is not None and probe.asked and not probe.as_number:
                out += probe.said(f"{parameter}[{key!r}]")
            elif isinstance(key, str):
                which = role(key)
                out.append(f"{parameter}[{key!r}] the cached {'keys' if which == 0 else 'values'}" if which is not None
                           else f"{parameter}[{key!r}] the number of cached positions")
            else:
                out.append(f"{parameter}[{key}] (your module's {self.layer_slots.get(key, 'index')}) the pair "
                           "(K_cache, V_cache)")
        return out


def _noted(name: str) -> Any:
    """An int method that notes the probe was taken as a number, then does what int does."""
    method = getattr(int, name)

    def noted(self: Probe, *args: Any) -> Any:
        self.as_number = True
        return method(self, *args)

    noted.__name__ = name
    return noted


class Probe(int, Answering):
    """The value of a key the code reads that names no tensor: n_cache, an int that notes whether the code takes it
    as a number (`as_number`: arithmetic, a comparison, an index) and answers keys as the cache does where the code
    reads it as a dict of its own (fairseq's `{"prev_key": .., "prev_value": ..}`)."""

    def __new__(cls, n_cache: int, parts: tuple[Any, Any]) -> Probe:
        made = super().__new__(cls, n_cache)
        made._start(parts, n_cache, {})
        made.as_number = False
        return made

    as_number: bool
    __hash__ = int.__hash__

    def __getitem__(self, key: Any) -> Any:
        found, value = self._read(key)
        if not found:
            raise KeyError(key)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self.written[key] = value

    def __contains__(self, key: object) -> bool:
        return self._read(key)[0]

    def get(self, key: Any, default: Any = None) -> Any:
        found, value = self._read(key)
        return value if found else default


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__mod__", "__neg__",
              "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__index__", "__int__", "__float__"):
    setattr(Probe, _name, _noted(_name))
Probe.__name__ = Probe.__qualname__ = "int"  # what the code was handed, in its errors


class Keyed(dict, Answering):  # type: ignore[type-arg]
    """A dict answering the keys the code reads (the module docstring's rules)."""

    def __init__(self, parts: tuple[Any, Any], n_cache: int, layer_slots: dict[int, str]) -> None:
        super().__init__()
        self._start(parts, n_cache, layer_slots)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.written[key] = value

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


def words(parameter: str, given: Keyed) -> str:
    """The note of a dict cache the code ran on: each key it read and what it got."""
    return (f"{parameter}: your code reads its cache as a dict keyed its own way, {', '.join(given.said(parameter))}; "
            "it is handed one that holds them. A convention, not a mistake: the reference reads the same keys and "
            "values")


def unfed(parameter: str, keys: list[tuple[Any, ...]]) -> str:
    """One line for a dict cache whose keys trace could not answer (each a path of keys, `Answering.unfed`)."""
    shown = ", ".join(parameter + "".join(f"[{k!r}]" for k in path) for path in keys)
    return (f"--cache: your code reads {shown} from its cache, which trace cannot feed: it answers a key naming keys "
            "or values, a key that is your module's own layer index (an int attribute such as layer_id) with that "
            "layer's (keys, values), and any other key with the number of cached positions, where your code takes "
            "it as a number, or with a dict answering the same, where it reads it by keys")
