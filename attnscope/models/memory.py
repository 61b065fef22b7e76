"""The memory estimates the guard meets (runs/memory.py), one per view:

- `whole`: a run that holds its whole pattern: layer L traced after layers 0..L (a page's, an encoder-decoder's,
  transformers' truncated load, a vision tower's, a VLM's), every layer streamed with its keys and values
  (--all-layers, --generate), an encoder-decoder's decoding;
- `blocked`: a long input, layer L's head computed in blocks of query rows (forward/long.py, seq2seq_long.py,
  vision/vlm_long.py).

Each reads what the source holds as data, a `Footprint`: the weights the run reads, the float32 numbers a token
takes (the residual stream and its activations) and the `[n, n]` float32 tensors it holds at once. A page says
what differs as data too, never by overriding a method: `expert_reads` (an `Experts`: mixture-of-experts weights
read a few at a time) and `extra_cells` (its own `[n, n]` tensors: an indexer's scores, a linear layer's M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from attnscope.models.checkpoint import Checkpoint

FLOAT32 = 4  # bytes


@dataclass(frozen=True)
class Footprint:
    """What a run holds besides a view's own tensors: `weights` (bytes), `per_token` float32 numbers a token (the
    residual stream and its activations) and `cells` float32 `[n, n]` tensors (every head's scores, masked and
    capped scores and attention, a page's own)."""

    weights: int
    per_token: int = 0
    cells: int = 0


@dataclass(frozen=True)
class Sizes:
    """A text model's sizes where no page reads them: from its config's values, transformers' defaults where one is
    left out (KV heads: one per head; d_head: d_model / n_head)."""

    d_model: int
    n_head: int
    n_kv_head: int
    d_head: int

    @classmethod
    def of(cls, get: Callable[[str], Any]) -> Sizes:
        """`get("hidden_size")` and the rest: a config's values, None where one is left out."""
        d_model, n_head = int(get("hidden_size") or 0), int(get("num_attention_heads") or 1)
        n_kv_head = int(get("num_key_value_heads") or n_head)
        return cls(d_model, n_head, n_kv_head, int(get("head_dim") or d_model // n_head))

    @property
    def qkv(self) -> int:
        """A token's queries, keys and values, in numbers."""
        return self.d_head * (self.n_head + 2 * self.n_kv_head)


@dataclass(frozen=True)
class Experts:
    """How a page reads its mixture-of-experts weights (the keys holding `.mlp.experts.`), which the shared
    estimate counts all held, as stored and as float32:
    - `reach` (n_experts, per_token): only the experts the tokens can choose are read, at most n_tokens · per_token
      of n_experts (DeepSeek's routed experts);
    - otherwise one expert at a time, `one` numbers held in float32 twice over (its copy and its product), beside
      every expert's stored bytes where `stored` (Qwen3-MoE reads rows of them) and none where not (GPT-OSS
      dequantizes one expert's MXFP4 blocks from the file)."""

    one: int = 0
    stored: bool = False
    reach: tuple[int, int] | None = None

    def change(self, checkpoint: Checkpoint, keys: list[str], n_tokens: int) -> int:
        """What reading the experts `keys` this way changes in the shared count, in bytes."""
        stored = sum(checkpoint.nbytes(k) for k in keys)
        every = stored + FLOAT32 * sum(math.prod(checkpoint.shape(k)) for k in keys)
        if self.reach is not None:
            n_experts, per_token = self.reach
            read = every * min(n_experts, n_tokens * per_token) // n_experts if keys else 0
        else:
            read = (stored if self.stored else 0) + 2 * FLOAT32 * self.one
        return read - every


def held(checkpoint: Checkpoint, keys: Iterable[str]) -> int:
    """Tensors `keys` as stored (what the pages read) and as float32."""
    return sum(checkpoint.nbytes(k) + FLOAT32 * math.prod(checkpoint.shape(k)) for k in keys)


def whole(source: Footprint, n_tokens: int, cache: int = 0) -> int:
    """A run over `n_tokens` positions that holds its whole pattern: the source's weights, its tokens' activations
    and its `[n_tokens, n_tokens]` tensors, and `cache` bytes of kept keys and values."""
    return source.weights + FLOAT32 * n_tokens * (source.per_token + source.cells * n_tokens) + cache


def blocked(source: Footprint, n_tokens: int, rows: int, *, qkv: int, cell: int, n_stream: int | None = None,
            mask: bool = False) -> int:
    """A long run, layer L's head in blocks of `rows` query rows: the source's weights, the residual stream and its
    activations over `n_stream` tokens (`n_tokens` unless told), layer L's queries, keys and values (`qkv` float32
    a token), one block (`cell` bytes for each of its rows' `n_tokens` keys) and with `mask` a boolean
    `[n_tokens, n_tokens]` mask held for the layers before L."""
    stream = n_tokens if n_stream is None else n_stream
    return (source.weights + FLOAT32 * (stream * source.per_token + n_tokens * qkv) + rows * n_tokens * cell
            + (n_tokens * n_tokens if mask else 0))
