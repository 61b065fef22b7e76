"""What `watch` does at each attention call it hears (watching/hooks.py): find the call's layer, and keep what the
pattern needs (watching/record.py). One `Listener` per with-block.

A layer's number is its module's `layer_idx` where transformers gave it one; otherwise (a plain `nn.Module`, or
a family whose modules carry none) the call's order in the forward, counted from 0 at each forward of the
watched model, as transformers' `output_attentions` lists them. In a model whose attention modules are numbered,
a module without a number (a VLM's vision tower) is not watched, and `notes` says so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnscope.watching.record import Call, Layer, slim

if TYPE_CHECKING:
    import torch


@dataclass
class Listener:
    modules: dict[int, str]  # id(module) -> its path in the model (named_modules)
    asked: set[int] | None  # the layers asked; None: every one
    layers: dict[int, Layer] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)  # every layer number a call was heard for, asked or not
    notes: list[str] = field(default_factory=list)
    forward: int = 0  # forwards of the watched model so far
    fresh: bool | None = None  # whether the current forward starts afresh (no filled cache); None: not known
    order: int = 0  # unnumbered calls heard in this forward
    numbered: bool = False  # the model's attention modules carry layer_idx
    owners: dict[int, int] = field(default_factory=dict)  # layer number -> id of the module that holds it
    plan: dict[int, int] | None = None  # id(module) -> its layer number, where layer_idx cannot be (`plan`)
    tokens: list[int] = field(default_factory=list)  # batch element 0's token ids, prompt and each step's
    gave_attentions: bool = False  # the caller asked the forward for output_attentions itself (outside families)
    copy_keys: bool = True  # the forward's cache may write into the keys it hands (not a DynamicCache): copy them
    cross: dict[int, bool] = field(default_factory=dict)  # id(module) -> its last call was cross-attention

    def heard(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An encoder-decoder's attention module is called (its forward pre-hook): cross-attention where it was
        handed the encoder's states (`key_value_states`: BART, T5, Whisper; `encoder_hidden_states`: BERT's)."""
        self.cross[id(module)] = any(kwargs.get(k) is not None for k in ("key_value_states", "encoder_hidden_states"))

    def begin(self, fresh: bool | None, ids: torch.Tensor | None, restart: bool) -> None:
        """A forward of the watched model starts (its forward pre-hook); `restart`: its token ids start over (no
        cache to continue)."""
        self.forward += 1
        self.fresh, self.order = fresh, 0
        if restart:
            self.tokens = []
        if ids is not None and ids.dim() == 2 and not ids.is_floating_point():
            self.tokens.extend(int(t) for t in ids[0].tolist())

    def number(self, module: Any, path: str) -> int | None:
        if self.plan is not None and id(module) in self.plan:
            return self.plan[id(module)]
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and not isinstance(index, bool):
            owner = self.owners.setdefault(index, id(module))
            if owner != id(module):
                self._note(f"{path} also calls itself layer {index}: not watched (the first module of that "
                           "number is)")
                return None
            return index
        if self.numbered:
            self._note(f"{path} has no layer_idx in a model whose attention layers are numbered: not watched")
            return None
        self.order += 1
        return self.order - 1

    def _note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def on_call(self, module: Any, query: torch.Tensor, key: torch.Tensor, mask: Any, impl: str,
                kwargs: dict[str, Any]) -> None:
        """transformers' attention interface: Q, K and the mask after the backend ran on them."""
        path = self.modules.get(id(module))
        if path is None:
            return
        number = self.number(module, path)
        if number is None:
            return
        self.seen.add(number)
        if self.asked is not None and number not in self.asked:
            return
        n_Q, d_head = int(query.shape[2]), int(query.shape[3])
        causal, window = None, None
        if mask is None and impl == "sdpa":  # sdpa_attention_forward's is_causal
            is_causal = kwargs.get("is_causal")
            is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
            causal = "top-left" if n_Q > 1 and is_causal else None
        elif _flash(impl) and (mask is None or getattr(mask, "dim", lambda: 0)() == 2):
            is_causal = kwargs.get("is_causal")
            is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
            causal = "bottom-right" if is_causal else None
            window = kwargs.get("sliding_window")
        if self.copy_keys:  # a fixed-size cache's keys (StaticCache): only the positions filled so far are kept.
            # Never where the cache grows by each step (DynamicCache's layers, DeepSeek-V3.2's indexed ones): there a
            # mask that hides the last keys from every query is a selection (a sparse indexer's top-k), not padding.
            real = filled(mask, n_Q, int(key.shape[2]), causal)
            if real < key.shape[2]:
                key = key[:, :, :real]
        scaling = kwargs.get("scaling")
        sinks = kwargs.get("s_aux")
        sinks = getattr(module, "sinks", None) if sinks is None else sinks
        import torch

        sinks = sinks.detach() if isinstance(sinks, torch.Tensor) else None
        bias = kwargs.get("position_bias")
        bias = bias.detach() if isinstance(bias, torch.Tensor) else None
        scale = float(scaling) if scaling is not None else d_head ** -0.5
        softcap = kwargs.get("softcap")
        softcap = float(softcap) if softcap is not None else None
        window = window if isinstance(window, int) else None
        kept = slim(query.detach())
        cross = self.cross.get(id(module), False)
        self._add(number, path, key, n_Q, key.shape[2], lambda row0, key0, count: Call(
            kept, row0, key0, count, mask, causal, window, scale, softcap, sinks, bias), last=not cross, cross=cross)

    def on_sdpa(self, query: torch.Tensor, key: torch.Tensor, attn_mask: Any, is_causal: bool, scale: Any,
                enable_gqa: bool) -> None:
        """F.scaled_dot_product_attention, called by a module of the watched model (found up the call stack)."""
        path = self._caller()
        if path is None:
            return
        number = self.order
        self.order += 1
        self.seen.add(number)
        if self.asked is not None and number not in self.asked:
            return
        Q, K = _four(query), _four(key)  # [n_batch, n_head, n, d]
        mask = attn_mask
        if mask is not None:
            while mask.dim() < 4:
                mask = mask.unsqueeze(0)
            mask = mask.reshape(-1, *mask.shape[-3:]) if mask.dim() > 4 else mask
        causal = "top-left" if is_causal else None  # torch's is_causal: the upper-left triangle
        scale = float(scale) if scale is not None else int(Q.shape[-1]) ** -0.5
        kept = slim(Q.detach())
        self._add(number, path, K, Q.shape[2], K.shape[2], lambda row0, key0, count: Call(
            kept, row0, key0, count, mask, causal, None, scale), last=False)  # torch's is_causal: top-left

    def direct(self, number: int, weights: torch.Tensor) -> None:
        """transformers' own attentions for a layer `[n_batch, n_head, n_Q, n_K]` (a family outside the
        interface, run eager with output_attentions), kept on the CPU in float32."""
        kept = weights.detach().float().cpu()
        self._add(number, f"layer {number}", None, kept.shape[2], kept.shape[3], lambda row0, key0, count: Call(
            None, row0, key0, count, None, None, None, 1.0, weights=kept))

    def _add(self, number: int, path: str, K: torch.Tensor | None, n_Q: int, n_K: int, make: Any,
             last: bool = True, cross: bool = False) -> None:
        layer = self.layers.get(number)
        if layer is None or layer.path != path:
            layer = self.layers[number] = Layer(number, path)
        layer.forward = self.forward
        if cross:
            layer.add_cross(int(n_Q), int(n_K), K, self.fresh, make)
        else:
            layer.add(int(n_Q), int(n_K), K, self.fresh, make, last, self.copy_keys)

    def _caller(self) -> str | None:
        """The innermost module of the watched model whose forward is on the call stack."""
        frame = sys._getframe(2)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if owner is not None:
                path = self.modules.get(id(owner))
                if path is not None:
                    return path or type(owner).__name__
            frame = frame.f_back  # type: ignore[assignment]
        return None


def plan(model: Any) -> tuple[dict[int, int] | None, str]:
    """Layer numbers for a model whose attention modules' `layer_idx` do not tell them apart (an encoder-decoder:
    Whisper's encoder has none, T5's encoder and decoder count from 0 each, a decoder layer's self- and
    cross-attention share one): every attention module (a class named ...Attention with a `layer_idx`) numbered
    in the model's module order, with a note; None where layer_idx is each module's own number."""
    found = [(name, m) for name, m in model.named_modules()
             if "Attention" in type(m).__name__ and hasattr(m, "layer_idx")]
    numbers = [getattr(m, "layer_idx", None) for _, m in found]
    if all(isinstance(n, int) for n in numbers) and len(set(numbers)) == len(numbers):
        return None, ""
    first, last = found[0][0], found[-1][0]
    return {id(m): i for i, (_, m) in enumerate(found)}, (
        f"this model's attention modules do not each carry their own layer_idx (an encoder-decoder's): layers are "
        f"numbered in module order, 0 = {first} to {len(found) - 1} = {last}; seen.paths names each")


def _flash(impl: str) -> bool:
    """Whether a backend takes flash attention's masks (None, or a `[n_batch, n_K]` padding mask: causal from the
    bottom right, the window from `sliding_window`): the mask function transformers registered for it is
    masking_utils' `flash_attention_mask` (flash_attention_2/3, and a hub kernel that
    hub_kernels.load_and_register_attn_kernel registered with flash's masks, "kernels-community/flash-attn3"), or,
    where none is registered, transformers' `is_flash_attention_requested` says so by its name."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

        return ALL_MASK_ATTENTION_FUNCTIONS[impl] is flash_attention_mask
    except (ImportError, KeyError):
        pass
    try:
        from transformers.utils.generic import is_flash_attention_requested

        return bool(is_flash_attention_requested(requested_attention_implementation=impl))
    except (ImportError, ValueError, TypeError):
        return impl.startswith("flash")


def filled(mask: Any, n_Q: int, n_K: int, causal: str | None = None) -> int:
    """How many of a call's keys are real: all `n_K`, but where the mask lets no query see the last ones (a
    StaticCache hands its whole `max_cache_len` buffer, the positions not yet written masked off, as
    masking_utils' `sdpa_mask`/`eager_mask` build them from `StaticLayer.get_mask_sizes`): the keys up to the last
    one any query may see. With no mask and SDPA's top-left `is_causal` (a static cache's prompt, where
    sdpa_mask skips the mask), no query sees past key n_Q - 1."""
    import torch

    if mask is None and causal == "top-left":
        return min(n_Q, n_K)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or n_K <= n_Q or mask.shape[-1] < n_K:
        return n_K

    def seen(part: torch.Tensor) -> torch.Tensor:  # True where a query may attend
        return part if part.dtype == torch.bool else part > torch.finfo(part.dtype).min / 2

    if bool(seen(mask[..., n_K - 1]).any()):  # the usual case, one column read: every key is real
        return n_K
    columns = seen(mask[..., :n_K]).flatten(0, -2).any(dim=0)  # [n_K]
    where = torch.nonzero(columns)
    return max(n_Q, int(where[-1]) + 1) if len(where) else n_K


def _four(x: torch.Tensor) -> torch.Tensor:
    """`[.., n, d]` as `[n_batch, n_head, n, d]`: one head where there is no head axis, leading axes as batch."""
    if x.dim() == 3:
        return x.unsqueeze(1)
    if x.dim() == 2:
        return x[None, None]
    return x.reshape(-1, *x.shape[-3:]) if x.dim() > 4 else x
