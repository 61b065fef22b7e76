"""ALiBi (Press et al., "Train Short, Test Long"): no position embeddings; each head adds `-m_h · (i - j)`
to the score of query i and key j, a penalty growing with the distance, with a slope m_h per head.

Slopes: for n heads, a power of two, `m_h = 2^(-8 (h + 1) / n)`. Otherwise the slopes of the nearest
lower power of two, then every other slope of the next power of two, as the paper's reference code and
BLOOM (`transformers.models.bloom.modeling_bloom.build_alibi_tensor`) compute them.

BLOOM adds `m_h · j` instead of `-m_h · (i - j)`. The two differ by `m_h · i`, the same for every key of a
query row, so the softmax, and the attention, are identical; the bias shown here is the paper's. With
attention sinks they are not: a sink's logit does not move with the row, so the row's constant counts, and
attnscope adds the paper's bias (check's float64 reference too).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from attnscope.errors import UsageError

if TYPE_CHECKING:
    from torch import Tensor


def slopes(n_head: int) -> Tensor:
    """`[n_head]` float32: m_h for h = 0 .. n_head - 1."""
    import torch

    if n_head < 1:
        raise UsageError(f"ALiBi needs at least one head; got {n_head}")
    closest = 2 ** math.floor(math.log2(n_head))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))  # 2^(-8 / closest)
    result = base ** torch.arange(1, closest + 1, dtype=torch.float32)
    if closest != n_head:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))  # 2^(-8 / (2 closest))
        remaining = min(closest, n_head - closest)
        extra = extra_base ** torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.float32)
        result = torch.cat([result, extra])
    return result


def bias(n_head: int, n_Q: int, n_K: int, offset: int = 0, device: Any = None,
         given: tuple[float, ...] | Tensor | None = None) -> Tensor:
    """`[n_head, n_Q, n_K]` float32: `-m_h · (i + offset - j)`; query i sits at position i + offset. `given`: the
    heads' slopes, computed by the caller (who shows them too) or where they are not `slopes(n_head)` (one head of
    a larger module); one per head."""
    import torch

    m = slopes(n_head) if given is None else torch.as_tensor(given, dtype=torch.float32)  # [n_head]
    if m.shape != (n_head,):
        raise UsageError(f"{{alibi_slopes}} gives {m.numel()} slopes for {n_head} heads; give one per head",
                         "alibi_slopes")
    query = torch.arange(n_Q, device=device, dtype=torch.float32)[:, None] + offset  # [n_Q, 1]
    key = torch.arange(n_K, device=device, dtype=torch.float32)[None, :]  # [1, n_K]
    return -m.to(device)[:, None, None] * (query - key)  # [n_head, n_Q, n_K]
