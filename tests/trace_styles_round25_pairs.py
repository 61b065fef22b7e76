"""Two deviations at once: a convention of the code's that the reference's causal mask hides (ALiBi's bias symmetric,
−m_h · |i − j|, as x-transformers' AlibiPositionalBias and MosaicBERT build it), with a mistake in the mask that
shows it (the band one key wider, the mask after the softmax, the mask transposed); and two mistakes at once (no
scale and the masked scores filled with 0). Styles: an x-transformers-like `Attend` (einsum, `triu(j - i + 1)`
masked with -finfo.max), a MosaicML-like functional attention (fused Wqkv, the bias and an additive causal mask
handed to F.scaled_dot_product_attention), a BLOOM-like `baddbmm` of the bias and the scores over [B·H, n, n] with
a boolean `tril` buffer and masked_fill(-inf)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes 2^(-8 h / heads), h = 1 .. heads (a power of two)."""
    start = 2 ** (-8 / heads)
    return torch.tensor([start ** (h + 1) for h in range(heads)])


def symmetric_bias(heads: int, n: int) -> torch.Tensor:
    """−m_h · |i − j| `[heads, n, n]`: the same as ALiBi's −m_h · (i − j) on and below the diagonal."""
    pos = torch.arange(n)
    return -alibi_slopes(heads)[:, None, None] * (pos[None, :] - pos[:, None]).abs()[None]


class XAttend(nn.Module):
    """An x-transformers-like attention: `to_q`, `to_k`, `to_v`, heads split by reshape and permute, the bias
    `-|j - i|` times the slopes, the causal mask `triu(j - i + 1)` filled with -finfo.max, einsums."""

    def __init__(self, dim=16, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        self.register_buffer("slopes", alibi_slopes(heads).view(heads, 1, 1), persistent=False)
        trained(self, 5)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in (self.to_q(x), self.to_k(x),
                                                                               self.to_v(x)))
        scale = 1.0 if self.bug == "no_scale_fill0" else q.shape[-1] ** -0.5
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
        i_arange, j_arange = torch.arange(n), torch.arange(n)
        dots = dots + self.slopes * -torch.abs(j_arange[None, None, :] - i_arange[None, :, None])
        causal = torch.ones((n, n), dtype=torch.bool).triu(n - n + (2 if self.bug == "causal_wide" else 1))
        if self.bug != "mask_after":
            dots = dots.masked_fill(causal, 0.0 if self.bug == "no_scale_fill0" else -torch.finfo(dots.dtype).max)
        attn = dots.softmax(dim=-1)
        if self.bug == "mask_after":
            attn = attn.masked_fill(causal, 0.0)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))


def mosaic_attention(x, Wqkv, out_proj, heads, bug=None):
    """MosaicML-like: a fused Wqkv split in thirds, the symmetric bias plus an additive causal mask
    (`triu(full(-inf), diagonal=1)`) handed to F.scaled_dot_product_attention as attn_mask."""
    b, n, dim = x.shape
    q, k, v = Wqkv(x).chunk(3, dim=-1)
    q, k, v = (t.view(b, n, heads, dim // heads).transpose(1, 2) for t in (q, k, v))
    diagonal = {"causal_wide": 2, "causal_narrow": 0}.get(bug, 1)
    causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=diagonal)
    bias = symmetric_bias(heads, n).to(x.dtype) + causal
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])
    return out_proj(out.transpose(1, 2).reshape(b, n, dim))


class MosaicBlock(nn.Module):
    def __init__(self, dim=16, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.Wqkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)
        trained(self, 5)

    def forward(self, x):
        return mosaic_attention(x, self.Wqkv, self.out_proj, self.heads, self.bug)


class BaddbmmAlibi(nn.Module):
    """BLOOM-like: q, k, v from one query_key_value Linear viewed per head as [B, n, H, 3, D], the bias and the
    scores joined by torch.baddbmm over [B·H, n, n], a boolean `tril` buffer, masked_fill(~mask, -inf)."""

    def __init__(self, dim=16, heads=4, max_len=32, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.query_key_value = nn.Linear(dim, 3 * dim)
        self.dense = nn.Linear(dim, dim)
        tri = torch.triu if bug == "causal_triu" else torch.tril
        self.register_buffer("causal", tri(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)
        trained(self, 5)

    def forward(self, x):
        b, n, dim = x.shape
        h, d = self.heads, dim // self.heads
        fused = self.query_key_value(x).view(b, n, h, 3, d)
        q, k, v = (fused[..., i, :].transpose(1, 2).reshape(b * h, n, d) for i in range(3))
        alibi = symmetric_bias(h, n).to(x.dtype).repeat(b, 1, 1)  # [B·H, n, n]
        scores = torch.baddbmm(alibi, q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(d))
        scores = scores.view(b, h, n, n).masked_fill(~self.causal[:n, :n], float("-inf"))
        probs = F.softmax(scores, dim=-1).view(b * h, n, n)
        ctx = torch.bmm(probs, v).view(b, h, n, d).permute(0, 2, 1, 3).reshape(b, n, dim)
        return self.dense(ctx)
