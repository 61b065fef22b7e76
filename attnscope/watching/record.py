"""What `watch` keeps of one attention call, and how a layer's calls line up into one pattern.

A call hands over Q `[n_batch, n_head, n_Q, d_head]` and K `[n_batch, n_kv_head, n_K, d_head]` after the
family's norms and RoPE, the mask as the backend takes it, and the spec's extras (scaling, softcap, sinks,
position_bias, window). Nothing is computed during the forward: the call's Q, its new keys and its mask are kept
(references, no copies, except the keys a cache may write over), and patterns are made afterwards
(watching/patterns.py).

A layer's calls line up as transformers' `generate` makes them: the prompt's forward, then each decode step
whose keys are the cache's (n_K > n_Q): its queries become the pattern's next rows and its new keys (the last
n_Q) the next columns, so the pattern covers the prompt and every new token, as `head --generate` shows it. A
sliding window's cache hands fewer keys than were seen: the step's keys are the newest ones (right-aligned, as
interface_stream.eager_step puts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Call:
    """One call's rows: its queries are the layer's rows `row0 ..`, its keys the layer's columns `key0 ..`
    (`n_K` of them); `mask` as the backend was handed it; `extras` the spec's keywords."""

    Q: torch.Tensor | None  # [n_batch, n_head, n_Q, d_head]; None where `weights` are transformers' own
    row0: int
    key0: int
    n_K: int
    mask: Any  # a tensor ([n_batch, 1, n_Q, n_K] bool or additive, or [n_batch, n_K] padding), a BlockMask, None
    causal: str | None  # where no mask is handed: "top-left" (SDPA's is_causal), "bottom-right" (flash's), None
    window: int | None  # flash's sliding_window where no mask is handed
    scale: float
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [n_head] logits
    position_bias: torch.Tensor | None = None  # [n_batch or 1, n_head, n_Q, n_K]
    weights: torch.Tensor | None = None  # [n_batch, n_head, n_Q, n_K]: output_attentions, where not recomputed

    @property
    def n_Q(self) -> int:
        return int((self.Q if self.Q is not None else self.weights).shape[2])  # type: ignore[union-attr]


@dataclass
class Layer:
    """One watched layer: its module's path, its calls in order, the keys seen so far (the chunks of K, each
    `[n_batch, n_kv_head, n, d_head]`), the forward it was last called in."""

    number: int
    path: str
    calls: list[Call] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)
    n_keys: int = 0
    n_rows: int = 0
    forward: int = -1
    notes: list[str] = field(default_factory=list)
    offset: int = 0  # row i's query sits at key position offset + i (a forward that computes only its last queries)

    @property
    def n_head(self) -> int:
        first = self.calls[0]
        return int((first.Q if first.Q is not None else first.weights).shape[1])  # type: ignore[union-attr]

    @property
    def n_kv_head(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else self.n_head

    @property
    def n_batch(self) -> int:
        first = self.calls[0]
        return int((first.Q if first.Q is not None else first.weights).shape[0])  # type: ignore[union-attr]

    def key_range(self, call: Call) -> torch.Tensor:
        """The call's keys `[n_batch, n_kv_head, n_K, d_head]`, from the chunks kept."""
        import torch

        joined = self.keys[0] if len(self.keys) == 1 else torch.cat(self.keys, dim=2)
        if len(self.keys) > 1:
            self.keys = [joined]  # joined once, kept joined
        return joined[:, :, call.key0:call.key0 + call.n_K]

    def add(self, n_Q: int, n_K: int, K: torch.Tensor | None, fresh: bool | None, make: Any,
            last: bool = False, copy: bool = True) -> None:
        """A call of `n_Q` queries over `n_K` keys (K, where the pattern is recomputed): a fresh forward starts
        the layer over; a continuing one (`fresh` False, or unknown and its keys the cache's: n_K > n_Q with the
        kept keys before them) appends rows and its new keys. `make(row0, key0, n_K)` builds the Call. `last`:
        a fresh call's queries are its keys' last ones (transformers' self-attention: a layer that computes only
        its last queries, Gemma 4's KV-shared layers in generate, has `offset` n_K - n_Q). `copy`: the keys may be
        a buffer the cache writes into later (a StaticCache's, which `reset()` also zeroes): kept as a copy, not a
        reference."""
        held = n_K - n_Q  # keys the cache handed from before this call
        continuing = bool(self.calls) and held > 0 and held <= self.n_keys if fresh is None else (
            not fresh and bool(self.calls))
        if continuing and not 0 < held <= self.n_keys:
            continuing = False  # a cache that does not grow by the new queries (a static one): start over
            self.notes.append(f"a forward's keys ({n_K}) do not follow the {self.n_keys} kept (a cache of fixed "
                              "size?): the pattern starts over from that forward")
        if not continuing:
            self.calls, self.keys, self.n_keys, self.n_rows = [], [], 0, 0
            if K is not None:
                self.keys.append(_own(K) if copy else slim(K.detach()))
            self.calls.append(make(0, 0, n_K))
            self.n_keys, self.n_rows = n_K, n_Q
            self.offset = max(0, n_K - n_Q) if last else 0
            return
        if K is not None:
            self.keys.append(_own(K[:, :, -n_Q:]))  # the new keys: [n_batch, n_kv_head, n_Q, d_head]
        self.n_keys += n_Q
        self.calls.append(make(self.n_rows, self.n_keys - n_K, n_K))
        self.n_rows += n_Q


    def add_cross(self, n_Q: int, n_K: int, K: torch.Tensor | None, fresh: bool | None, make: Any) -> None:
        """A cross-attention call (an encoder-decoder's decoder over the encoder's states): each decode step's
        queries are the next rows over the same source keys, as generate's `cross_attentions` stack them; a fresh
        forward, or other source keys, starts the layer over."""
        if self.calls and fresh is not True and n_K == self.n_keys:
            self.calls.append(make(self.n_rows, 0, n_K))
            self.n_rows += n_Q
            return
        self.calls, self.keys = [make(0, 0, n_K)], [] if K is None else [slim(K.detach())]
        self.n_keys, self.n_rows, self.offset = n_K, n_Q, 0


def _own(K: torch.Tensor) -> torch.Tensor:
    """The keys, copied: a cache may hand its own buffer and write the next step into it (StaticCache); a decode
    step's few new keys are a slice of the step's whole K, which a reference would keep alive."""
    return K.detach().clone()


def slim(x: torch.Tensor) -> torch.Tensor:
    """`x` itself, or a copy of just its elements where it is a view of a bigger tensor (a fused QKV projection's
    slice, GPT-2's `c_attn` split): a reference would keep the whole bigger tensor alive after the forward."""
    if x.untyped_storage().nbytes() > x.numel() * x.element_size():
        return x.contiguous() if not x.is_contiguous() else x.clone()
    return x
