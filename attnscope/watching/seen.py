"""What a `watch` saw (attnscope.watch): each watched layer's calls, made into patterns on demand.

`pattern(layer, head)` is `[n_Q, n_K]`, `seen[layer]` the layer's heads as `model_head` gives them
(readings/headstats.py's `LayerHeads`: statistics, kinds, readings, the notebook display), `html(path)` the
explorer page `--html` writes, `check()` the patterns held against a float64 reference from the recorded Q, K
and masks (check/watched.py), to float32's tolerance (check/comparison.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from attnscope.check.comparison import Comparison
    from attnscope.readings.headstats import LayerHeads
    from attnscope.watching.listen import Listener
    from attnscope.watching.record import Layer


class Seen:
    def __init__(self, listener: Listener, layers: list[int] | None, heads: list[int] | None, model: str,
                 route: str) -> None:
        self._listener = listener
        self.asked_layers, self.asked_heads = layers, heads
        self.model, self.route = model, route
        self.notes: list[str] = []

    @property
    def layers(self) -> list[int]:
        """The layers watched and heard, in order."""
        return sorted(number for number, layer in self._listener.layers.items() if layer.calls)

    @property
    def paths(self) -> dict[int, str]:
        """Each watched layer's module, as named_modules names it."""
        return {number: self._listener.layers[number].path for number in self.layers}

    @property
    def tokens(self) -> list[int]:
        """Batch element 0's token ids as the forwards were handed them (the prompt, then each decode step's)."""
        return list(self._listener.tokens)

    def all_notes(self) -> list[str]:
        layers = [note for n in self.layers for note in self._listener.layers[n].notes]
        return [*self.notes, *self._listener.notes, *layers]

    def _layer(self, layer: int) -> Layer:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise UsageError(f"layer: {layer!r} is not a layer number; give an integer")
        found = self._listener.layers.get(layer)
        if found is not None and found.calls:
            return found
        watched = ", ".join(map(str, self.layers)) or "none"
        if self.asked_layers is not None and layer not in self.asked_layers:
            raise UsageError(f"layer: layer {layer} was not asked for; the layers watched are {watched} (pass it "
                             "in watch(..., layers=...))")
        if not self._listener.forward and not self._listener.layers:
            raise UsageError(f"layer: nothing was seen yet; run the model inside the with-block (layer {layer})")
        heard = sorted(self._listener.seen)
        raise UsageError(f"layer: no attention call of layer {layer} was seen; the layers watched are {watched}"
                         + ("" if heard else " (no call reached transformers' attention interface or "
                            "F.scaled_dot_product_attention)"))

    def _heads(self, layer: Layer, head: int | None = None) -> list[int]:
        n_head = layer.n_head
        if head is not None:
            if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < n_head:
                raise UsageError(f"head: {head!r} is out of range; layer {layer.number} has {n_head} heads "
                                 f"(0..{n_head - 1})")
            if self.asked_heads is not None and head not in self.asked_heads:
                raise UsageError(f"head: head {head} was not asked for; the heads watched are "
                                 f"{', '.join(map(str, self.asked_heads))}")
            return [head]
        return [h for h in (self.asked_heads or range(n_head)) if h < n_head]

    def _batch(self, layer: Layer, batch: int) -> int:
        if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch < layer.n_batch:
            raise UsageError(f"batch: {batch!r} is out of range; the forward had {layer.n_batch} batch "
                             f"element{'s' if layer.n_batch != 1 else ''} (0..{layer.n_batch - 1})")
        return batch

    def offset(self, layer: int) -> int:
        """Where the layer's first query row sits among its keys (query i at position offset + i): 0, but for a
        layer that computed only its last queries (Gemma 4's KV-shared layers on a prompt in generate)."""
        return self._layer(layer).offset

    def pattern(self, layer: int, head: int, batch: int = 0) -> torch.Tensor:
        """Head `head` of layer `layer` on batch element `batch`: `[n_Q, n_K]`, float32 on the CPU; after
        `generate`, the prompt's rows and a row for every decode step (keys not handed, a window's evicted ones,
        are 0). Query row i sits at key position `offset(layer) + i`."""
        from attnscope.watching.patterns import layer_pattern

        found = self._layer(layer)
        return layer_pattern(found, self._heads(found, head), self._batch(found, batch))[0]

    def patterns(self, layer: int, batch: int = 0) -> torch.Tensor:
        """Every head of the layer `[n_head, n_Q, n_K]` (heads not asked for are 0)."""
        import torch

        from attnscope.watching.patterns import layer_pattern

        found = self._layer(layer)
        heads = self._heads(found)
        made = layer_pattern(found, heads, self._batch(found, batch))
        if len(heads) == found.n_head:
            return made
        full = torch.zeros(found.n_head, *made.shape[1:])
        full[torch.tensor(heads)] = made
        return full

    def __getitem__(self, layer: int) -> LayerHeads:
        """The layer's heads on batch element 0, as `model_head(...).heads` gives them."""
        return self.heads(layer)

    def heads(self, layer: int, batch: int = 0) -> LayerHeads:
        from attnscope.readings.headstats import LayerHeads

        found = self._layer(layer)
        attention = self.patterns(layer, batch)
        tokens = self._listener.tokens if batch == 0 and len(self._listener.tokens) == attention.shape[-1] else None
        labels = [str(i) for i in range(attention.shape[-1])]
        rows = labels[found.offset:found.offset + attention.shape[-2]]
        made = LayerHeads.of(attention, f"layer {layer} ({found.path})", rows, labels, offset=found.offset, batch=batch,
                             tokens=tokens, sink_weight=self._sink_weight(found, batch))
        asked = set(self._heads(found))
        made.heads = [h for h in made.heads if h["head"] in asked]
        return made

    def _sink_weight(self, layer: Layer, batch: int) -> torch.Tensor | None:
        """A learned sink's weight per query `[n_head, n_Q]`: 1 minus each row's sum."""
        if all(call.sinks is None for call in layer.calls):
            return None
        attention = self.patterns(layer.number, batch)
        return (1 - attention.double().sum(-1)).clamp(min=0.0)

    def html(self, path: str | Path, *, force: bool = False) -> Path:
        """The explorer page `--html` writes (views/explorer.py): every watched layer's heads, one file."""
        from attnscope.readings.headstats import describe
        from attnscope.tensors import write_text
        from attnscope.views.explorer import page_html
        from attnscope.views.sources import from_layers

        if not self.layers:
            raise UsageError("path: nothing was watched yet to draw; run the model inside the with-block first")
        first = self._listener.layers[self.layers[0]]
        tokens = [str(t) for t in self._listener.tokens] if len(self._listener.tokens) == first.n_keys else \
            [str(i) for i in range(first.n_keys)]
        layers = [(n, self.patterns(n)) for n in self.layers if self._listener.layers[n].n_keys == len(tokens)
                  and self._listener.layers[n].n_rows == len(tokens)]
        page = from_layers(f"attnscope watch: {self.model}", tokens, layers,
                           header=[f"{self.model}, watched: layers {', '.join(map(str, self.layers))}"],
                           describe=describe)
        page.notes = self.all_notes()
        return write_text(page_html(page), path, force=force, formats=(".html", ".htm"))

    def check(self) -> list[Comparison]:
        """Each watched layer's patterns (every head, every batch element) against check/watched.py's float64
        formula from the recorded Q, K and masks; layers given as transformers' own attentions are left out."""
        from attnscope.check.comparison import compare

        results = []
        for number in self.layers:
            layer = self._listener.layers[number]
            if any(call.Q is None for call in layer.calls):
                continue
            heads = self._heads(layer)
            for batch in range(layer.n_batch):
                from attnscope.watching.patterns import layer_pattern

                ours = layer_pattern(layer, heads, batch)
                results.append(compare(f"layer {number}" + (f", batch {batch}" if layer.n_batch > 1 else ""),
                                       "float64 formula from the recorded Q, K and mask", ours,
                                       _reference(layer, heads, batch)))
        return results

    def __repr__(self) -> str:
        layers = self.layers
        if not layers:
            return f"<watched {self.model}: nothing seen yet>"
        first = self._listener.layers[layers[0]]
        return (f"<watched {self.model}: {len(layers)} layer{'s' if len(layers) != 1 else ''} "
                f"({', '.join(map(str, layers[:8]))}{', ...' if len(layers) > 8 else ''}), {first.n_rows} queries "
                f"x {first.n_keys} keys>")


def _reference(layer: Layer, heads: list[int], batch: int) -> torch.Tensor:
    """The layer's `[n_heads, n_rows, n_keys]` float64 reference, each call's block placed as the pattern's."""
    from types import SimpleNamespace

    import torch

    from attnscope.check.watched import reference

    out = torch.zeros(len(heads), layer.n_rows, layer.n_keys, dtype=torch.float64)
    index = torch.tensor(heads)
    group = layer.n_head // layer.n_kv_head
    for call in layer.calls:
        assert call.Q is not None
        K = layer.key_range(call)[batch].cpu()[index // group]  # [n_heads, n_K, d_head]
        part = SimpleNamespace(scale=call.scale, softcap=call.softcap, causal=call.causal, window=call.window,
                               sinks=None if call.sinks is None else call.sinks.cpu().reshape(-1)[index],
                               position_bias=_per_head(call.position_bias, batch, index, call.n_K),
                               mask=_allowed(call, batch, index))
        out[:, call.row0:call.row0 + call.n_Q, call.key0:call.key0 + call.n_K] = reference(
            call.Q[batch].cpu()[index], K, part)
    return out


def _per_head(tensor: torch.Tensor | None, batch: int, index: torch.Tensor, n_K: int) -> torch.Tensor | None:
    if tensor is None:
        return None
    one = tensor.cpu()[batch if tensor.shape[0] > 1 else 0]  # [1 or n_head, n_Q, n_K]
    return (one[index] if one.shape[0] > 1 else one)[..., :n_K]


def _allowed(call: Any, batch: int, index: torch.Tensor) -> torch.Tensor | None:
    """The call's mask for the reference, `[1 or n_heads, n_Q, n_K]`: bool (True may attend) or additive."""
    import torch

    mask = call.mask
    if mask is None:
        return None
    if hasattr(mask, "mask_mod"):
        q = torch.arange(call.n_Q)[:, None]
        k = torch.arange(call.n_K)[None, :]
        return mask.mask_mod(torch.tensor(batch), torch.tensor(0), q, k).cpu()[None]
    if mask.dim() == 2:
        return mask.cpu()[batch, :call.n_K].bool()[None, None, :].expand(1, call.n_Q, call.n_K)
    return _per_head(mask, batch, index, call.n_K)
