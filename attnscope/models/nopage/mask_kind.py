"""What kind of mask transformers built for a layer, read from the mask itself (models/nopage/interface.py).

transformers' masking_utils builds one mask per layer type (`create_causal_mask`,
`create_sliding_window_causal_mask`, `create_chunked_causal_mask`, `create_bidirectional_mask`, ...) and hands it
to the attention function as `attention_mask`: for eager, a float `[n_batch, 1, n_Q, n_K]` with 0 where a query
may attend and the dtype's minimum where it may not (`eager_mask`), or None where nothing is masked. Which one a
layer got is read back here by comparing the allowed (query, key) pairs with each rule:

- causal: key j <= query i (+ n_K - n_Q with a cache);
- sliding W: causal and i - j < W;
- chunked C: causal and i // C == j // C (Llama 4);
- bidirectional: every key; bidirectional sliding: |i - j| <= a reach (ModernBERT's window // 2, transformers'
  `sliding_window_bidirectional_overlay`);
- custom: none of these (padding, packed sequences, a family's own rule).

A window wider than the text leaves a causal mask; the caller compares with the layer's own `sliding_window`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MaskKind:
    kind: str  # "causal", "sliding", "chunked", "bidirectional", "bidirectional sliding", "custom"
    size: int | None = None  # the window or chunk

    @property
    def causal(self) -> bool:
        return self.kind in ("causal", "sliding", "chunked")

    def describe(self) -> str:
        sizes = {"sliding": f"sliding window {self.size}", "chunked": f"chunked attention, chunks of {self.size}",
                 "bidirectional sliding": f"bidirectional window, |i - j| <= {self.size}"}
        return sizes.get(self.kind, self.kind)


def allowed_pairs(mask: torch.Tensor | None, n_Q: int, n_K: int) -> torch.Tensor | None:
    """The (query, key) pairs the mask lets through, `[n_Q, n_K]` bool, from an additive float mask (a pair is
    allowed where the mask is above half the dtype's minimum) or a boolean one; None without a mask."""
    import torch

    if mask is None:
        return None
    grid = mask.reshape(-1, *mask.shape[-2:])[0][..., -n_Q:, :n_K]  # batch 0, head 0: [n_Q, n_K]
    if grid.dtype == torch.bool:
        return grid
    return grid > torch.finfo(grid.dtype).min / 2


def read_mask(allowed: torch.Tensor | None) -> MaskKind:
    import torch

    if allowed is None or bool(allowed.all()):
        return MaskKind("bidirectional")
    n_Q, n_K = allowed.shape
    offset = n_K - n_Q
    ones = torch.ones(n_Q, n_K, dtype=torch.bool)
    causal = ones.tril(diagonal=offset)
    if torch.equal(allowed, causal):
        return MaskKind("causal")
    rows = torch.arange(n_Q)[:, None] + offset
    cols = torch.arange(n_K)[None, :]
    width = int(allowed.sum(-1).max())
    if torch.equal(allowed, causal & (rows - cols < width)):
        return MaskKind("sliding", width)
    for chunk in range(1, n_K + 1):
        if torch.equal(allowed, causal & (rows // chunk == cols // chunk)):
            return MaskKind("chunked", chunk)
    reach = int((allowed.long() * (cols - rows)).max())  # the farthest key after a query
    if torch.equal(allowed, (rows - cols).abs() <= reach):
        return MaskKind("bidirectional sliding", reach)
    return MaskKind("custom")
