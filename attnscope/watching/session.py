"""`attnscope.watch(model, layers=None, heads=None)`: the with-block that watches a model the user already
holds, and `Seen`, what it saw (docs/python-api.md).

Where it listens (watching/hooks.py): a transformers model whose attention goes through transformers' attention
interface at its interface, on whichever backend it was loaded with; any other `nn.Module` at
`F.scaled_dot_product_attention`. A transformers family that computes its attention in its own code (BLOOM,
Falcon, MPT, GPT-J) is said so in `notes`, and where it runs eager attention, transformers' own
`output_attentions` are taken from each forward (asked for by a forward pre-hook, and handed back only where the
caller asked for them too).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from attnscope.watching.listen import Listener
    from attnscope.watching.seen import Seen

_ACTIVE: list[Any] = []  # the watch whose with-block runs (one at a time: the patches are process-wide)


class Watch:
    """The context manager `watch()` returns; entering it hands back the `Seen` it fills."""

    def __init__(self, model: Any, layers: Any = None, heads: Any = None) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"model: watch takes a torch.nn.Module (a transformers model, or any module), not "
                             f"{type(model).__name__}")
        from attnscope.watching.listen import plan

        self.model = model
        self.route = _route(model)
        self.plan, self.planned = plan(model) if self.route == "interface" else (None, "")
        self.n_layer, self.n_head = _sizes(model)
        if self.plan is not None:  # an encoder-decoder's attention modules, numbered in module order
            self.n_layer, self.n_head = len(self.plan), None
        self.layers = _numbers(layers, "layers", self.n_layer, "layer")
        self.heads = _numbers(heads, "heads", self.n_head, "head")
        self.seen: Seen | None = None
        self._handles: list[Any] = []
        self._patch: Any = None

    def __enter__(self) -> Seen:
        from attnscope.watching import hooks
        from attnscope.watching.listen import Listener
        from attnscope.watching.seen import Seen

        if _ACTIVE:
            raise UsageError("watch: another watch is active; watch one model at a time (end the outer with-block "
                             "first, or pass both layers to one watch)")
        modules = {id(m): name for name, m in self.model.named_modules()}
        listener = Listener(modules, None if self.layers is None else set(self.layers))
        listener.numbered = any(isinstance(getattr(m, "layer_idx", None), int) for m in self.model.modules())
        listener.plan = self.plan
        self.seen = Seen(listener, self.layers, self.heads, type(self.model).__name__, self.route)
        if self.planned:
            self.seen.notes.append(self.planned)
        if self.route == "outside":
            self.seen.notes.append(_outside_note(self.model))
        self._handles.append(self.model.register_forward_pre_hook(self._begin(listener), with_kwargs=True))
        if self.plan is not None:  # an encoder-decoder: which of its attention calls are cross-attention
            self._handles.extend(m.register_forward_pre_hook(listener.heard, with_kwargs=True)
                                 for m in self.model.modules() if id(m) in self.plan)
        if self.route == "outside" and _eager(self.model):
            self._handles.append(self.model.register_forward_hook(self._attentions(listener), with_kwargs=True))
        self._patch = hooks.patched(listener.on_call if self.route == "interface" else None,
                                    listener.on_sdpa if self.route == "sdpa" else None)
        try:
            self._patch.__enter__()
        except BaseException:
            self._remove()
            raise
        _ACTIVE.append(self)
        return self.seen

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        try:
            self._patch.__exit__(*exc)
        finally:
            self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _begin(self, listener: Listener) -> Any:
        outside = self.route == "outside" and _eager(self.model)

        def pre_hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            import torch

            cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.24 renamed it `cache`
            fresh: bool | None = None  # not known: each layer's keys say (watching/record.py)
            if self.route != "sdpa" or cache is not None:
                fresh = True if cache is None or _empty(cache) else None
            ids = kwargs.get("input_ids", args[0] if args else None)
            listener.begin(fresh, ids if isinstance(ids, torch.Tensor) else None, fresh is True or cache is None)
            listener.copy_keys = self.route == "sdpa" or (cache is not None and _writes_in_place(cache))
            if outside:
                kwargs = dict(kwargs)
                listener.gave_attentions = bool(kwargs.get("output_attentions"))
                kwargs["output_attentions"] = True
                return args, kwargs
            return None

        return pre_hook

    def _attentions(self, listener: Listener) -> Any:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
            attentions = getattr(output, "attentions", None)
            if attentions is None:
                return None
            for number, weights in enumerate(attentions):
                if weights is None:
                    continue
                listener.seen.add(number)
                if listener.asked is None or number in listener.asked:
                    listener.direct(number, weights)
            if not listener.gave_attentions:
                output.attentions = None  # the caller did not ask for them: its output as it would have been
            return None

        return hook


def watch(model: Any, layers: int | Iterable[int] | None = None, heads: int | Iterable[int] | None = None) -> Watch:
    """Watch `model`'s attention for one with-block, without changing what it computes (`attnscope.watch`):

        with watch(model, layers=[5, 12]) as seen:
            out = model(**inputs)          # or model.generate(**inputs, max_new_tokens=20)
        seen.pattern(12, 3)                # [n_Q, n_K], CPU float32

    `layers` (default every one) and `heads` (default every one) say what to keep. See `Seen`."""
    return Watch(model, layers, heads)


def _sizes(model: Any) -> tuple[int | None, int | None]:
    """The number of layers and heads a transformers config says (its text config's), None where not known."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layer = next((v for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(
        v := getattr(text, k, None), int)), None)
    n_head = next((v for k in ("num_attention_heads", "n_head", "num_heads") if isinstance(
        v := getattr(text, k, None), int)), None)
    return n_layer, n_head


def _numbers(given: Any, name: str, count: int | None, what: str) -> list[int] | None:
    """`layers` or `heads` as a sorted list of ints (None: every one), each checked against `count` where known."""
    if given is None:
        return None
    items = [given] if isinstance(given, int) else given
    try:
        items = list(items)
    except TypeError:
        raise UsageError(f"{name}: give a {what} number or a list of them, not {type(given).__name__}") from None
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise UsageError(f"{name}: {item!r} is not a {what} number; give integers")
        if item < 0 or (count is not None and item >= count):
            span = f"this model has {count} {what}s (0..{count - 1})" if count else f"{what}s count from 0"
            raise UsageError(f"{name}: {what} {item} is out of range; {span}")
    if not items:
        raise UsageError(f"{name}: the list is empty; give at least one {what}, or None for every {what}")
    return sorted(set(items))


def _route(model: Any) -> str:
    """"interface" (a transformers family calling the attention interface), "outside" (one computing its
    attention in its own code), "sdpa" (any other module)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return "sdpa"
    if not isinstance(model, PreTrainedModel):
        return "sdpa"
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        if getattr(type(module), "_supports_attention_backend", False) or \
                "ALL_ATTENTION_FUNCTIONS" in vars(sys.modules.get(type(module).__module__, sys)):
            return "interface"
    return "outside"


def _empty(cache: Any) -> bool:
    """Whether a transformers cache holds nothing yet (a forward that starts a generate): every layer's length 0
    (a hybrid's cache: its first layer may be a linear one whose length reads 0 at every step)."""
    layers = getattr(cache, "layers", None)
    try:
        if layers:
            return all(int(layer.get_seq_length()) == 0 for layer in layers if hasattr(layer, "get_seq_length"))
        return int(cache.get_seq_length()) == 0
    except (TypeError, ValueError, AttributeError, RuntimeError):
        return False


def _writes_in_place(cache: Any) -> bool:
    """Whether a transformers cache may write into the keys it handed out: a StaticCache's layers
    (`is_compileable`: fixed buffers, `index_copy_` at each step, zeroed by `reset()`), or a cache whose layers are
    not known. DynamicCache's layers concatenate into a new tensor at each update (`DynamicLayer.update`), so its
    keys are kept by reference, not copied."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return True
    return any(getattr(layer, "is_compileable", True) or not hasattr(layer, "get_seq_length") for layer in layers)


def _eager(model: Any) -> bool:
    """Whether the model runs its own eager attention, which hands out its weights with output_attentions without
    computing anything else: loaded eager, or a family with no other attention (BLOOM, MPT)."""
    cls = type(model)
    only_eager = not any(getattr(cls, name, False) for name in ("_supports_sdpa", "_supports_flash_attn",
                                                                 "_supports_flex_attn"))
    return only_eager or getattr(getattr(model, "config", None), "_attn_implementation", None) == "eager"


def _outside_note(model: Any) -> str:
    name = type(model).__name__
    if _eager(model):
        return (f"{name} computes its attention in its own code, not through transformers' attention interface: "
                "the patterns are transformers' own output_attentions from its eager attention")
    return (f"{name} computes its attention in its own code, not through transformers' attention interface: "
            "nothing is watched; load it with attn_implementation=\"eager\" to get transformers' own attentions")
