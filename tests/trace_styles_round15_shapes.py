"""Attention modules whose inputs, queries, keys or values are of other shapes than `[n_batch, n, d_feat]` from the
forward's one input, written as real libraries write them, for tests/test_trace_round15_shapes.py: an input laid out
as an image `[B, H, W, C]` (SAM's and ViTDet's image encoders, an NHWC block), queries read from some of the input's
tokens (CaiT's class attention, a Perceiver-AR-like last-tokens query, a pooled query), queries, keys or values
pooled along the tokens after their projection (Linformer's projected sequence, MViTv2's pooled heads, a strided
convolution of the keys and values, Hiera's one mask unit `[B, heads, 1, N, d]`). Each class takes `bug`: None is
the correct module, any other a planted mistake."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# --- an input laid out as an image [B, H, W, C] --------------------------------------------------------------------


class ImageEncoderAttention(nn.Module):
    """SAM-like: `B, H, W, _ = x.shape`, a fused qkv reshaped to `(3, B·heads, H·W, d)`, the heads merged back to
    `[B, H, W, C]`; bug 'unscaled': no 1/√d_head; 'merge': the heads merged without the permute."""

    def __init__(self, dim: int = 32, num_heads: int = 4, bug: str | None = None):
        super().__init__()
        self.num_heads, self.scale, self.bug = num_heads, (dim // num_heads) ** -0.5, bug
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * self.num_heads, H * W, -1).unbind(0)  # each [B·heads, H·W, d]
        attn = q @ k.transpose(-2, -1) if self.bug == "unscaled" else (q * self.scale) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x = (attn @ v).view(B, self.num_heads, H, W, -1)  # [B, heads, H, W, d]
        x = x.reshape(B, H, W, -1) if self.bug == "merge" else x.permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        return self.proj(x)


class ChannelsLastAttention(nn.Module):
    """An NHWC block (EfficientFormer/ConvNeXt-like): the image flattened to tokens with `x.flatten(1, 2)`,
    separate q/k/v, F.scaled_dot_product_attention, the output viewed back as the image; bug 'axis': a softmax by
    hand over the queries' axis."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, h, w, c = x.shape
        t = x.flatten(1, 2)  # [b, h·w, c]
        q, k, v = (f(t).unflatten(-1, (self.heads, -1)).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        if self.bug == "axis":
            o = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-2) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(o.transpose(1, 2).reshape(b, h, w, c))


class WindowlessNHWC(nn.Module):
    """ViTDet-like global attention of a `[B, H, W, C]` input written with einsum over the grid itself: q, k, v
    kept `[B, heads, H, W, d]`, the scores `[B, heads, H, W, H, W]`; bug 'values': v from the key projection."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, H, W, C = x.shape
        d = C // self.heads
        q = self.q(x).view(B, H, W, self.heads, d).permute(0, 3, 1, 2, 4)
        k, v = self.kv(x).view(B, H, W, 2, self.heads, d).permute(3, 0, 4, 1, 2, 5).unbind(0)
        if self.bug == "values":
            v = k
        s = torch.einsum("bnhwd,bnijd->bnhwij", q, k) * d ** -0.5
        a = s.flatten(-2).softmax(-1).view_as(s)
        o = torch.einsum("bnhwij,bnijd->bhwnd", a, v)
        return self.out(o.reshape(B, H, W, C))


# --- queries read from some of the input's tokens ------------------------------------------------------------------


class ClassTokenAttention(nn.Module):
    """CaiT-like class attention with a fused key/value projection: the queries from the class token alone,
    `self.q(x[:, 0])`, the keys and values from every token, the class token's update `[B, 1, C]` returned;
    bug 'twice': the scale applied to q and again to the scores."""

    def __init__(self, dim: int = 32, num_heads: int = 4, bug: str | None = None):
        super().__init__()
        self.num_heads, self.scale, self.bug = num_heads, (dim // num_heads) ** -0.5, bug
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q = self.q(x[:, 0]).reshape(B, self.num_heads, 1, C // self.num_heads)
        kv = self.kv(x).reshape(B, N, 2, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if self.bug == "twice":
            attn = attn * self.scale
        x_cls = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, 1, C)
        return self.proj(x_cls)


class LastTokensQuery(nn.Module):
    """Perceiver-AR-like: the last two tokens query every token (`x[:, -2:]`), separate projections,
    F.scaled_dot_product_attention; bug 'merge': the heads merged without the transpose."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        latents = x[:, -2:]
        q = self.to_q(latents).view(b, 2, self.heads, -1).transpose(1, 2)
        k = self.to_k(x).view(b, n, self.heads, -1).transpose(1, 2)
        v = self.to_v(x).view(b, n, self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v)  # [b, heads, 2, d]
        o = o.reshape(b, 2, -1) if self.bug == "merge" else o.transpose(1, 2).reshape(b, 2, -1)
        return self.to_out(o)


class MeanQueryPool(nn.Module):
    """Attention pooling: one query, the mean of the tokens (`x.mean(dim=1, keepdim=True)`), over every token;
    nn.Linear q, k, v; bug 'unscaled': no 1/√d_head."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, c = x.shape
        pooled = x.mean(dim=1, keepdim=True)  # [b, 1, c]
        q = self.wq(pooled).view(b, 1, self.heads, -1).permute(0, 2, 1, 3)
        k = self.wk(x).view(b, n, self.heads, -1).permute(0, 2, 1, 3)
        v = self.wv(x).view(b, n, self.heads, -1).permute(0, 2, 1, 3)
        s = q @ k.transpose(-1, -2)
        if self.bug != "unscaled":
            s = s / (c // self.heads) ** 0.5
        o = s.softmax(-1) @ v
        return self.wo(o.permute(0, 2, 1, 3).reshape(b, 1, c))


# --- queries, keys or values pooled along the tokens after their projection ---------------------------------------


class ProjectedSequence(nn.Module):
    """Linformer-like: the keys and values projected along the sequence after their projections by matrices of
    the module's (`einsum('bnd,nk->bkd', keys, proj_k)`), n_K = k; bug 'values': the values made from the keys'
    projection; 'twice': the scores scaled twice."""

    def __init__(self, dim: int = 32, seq_len: int = 10, k: int = 4, heads: int = 4, bug: str | None = None):
        super().__init__()
        self.heads, self.k, self.bug = heads, k, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.proj_k = nn.Parameter(torch.randn(seq_len, k) / k ** 0.5)
        self.proj_v = nn.Parameter(torch.randn(seq_len, k) / k ** 0.5)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        dh = d // self.heads
        queries = self.to_q(x).reshape(b, n, self.heads, dh).transpose(1, 2)
        keys = self.to_k(x)
        values = self.to_k(x) if self.bug == "values" else self.to_v(x)
        keys = torch.einsum("bnd,nk->bkd", keys, self.proj_k[:n])
        values = torch.einsum("bnd,nk->bkd", values, self.proj_v[:n])
        keys, values = (t.reshape(b, self.k, self.heads, dh).transpose(1, 2) for t in (keys, values))
        dots = torch.einsum("bhnd,bhkd->bhnk", queries, keys) * dh ** -0.5
        if self.bug == "twice":
            dots = dots * dh ** -0.5
        out = torch.einsum("bhnk,bhkd->bhnd", dots.softmax(dim=-1), values)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class PooledHeads(nn.Module):
    """MViTv2-like pooling attention: q, k and v each split into heads, then average-pooled along the tokens with
    stride 2 (`F.avg_pool1d` per head), the output as long as the pooled queries; bug 'axis': the softmax over the
    queries' axis."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    @staticmethod
    def _pool(t):
        b, h, n, d = t.shape  # [b, h, n, d] -> [b, h, n // 2, d]
        return F.avg_pool1d(t.reshape(b * h, n, d).transpose(1, 2), 2, 2).transpose(1, 2).reshape(b, h, -1, d)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = self._pool(q), self._pool(k), self._pool(v)
        attn = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-2 if self.bug == "axis" else -1)
        out = (attn @ v).transpose(1, 2).reshape(b, -1, c)
        return self.proj(out)


class StridedKeyValues(nn.Module):
    """Keys and values reduced after their projection by a strided depthwise convolution of the module's
    (`F.conv1d(.., groups=C, stride=2)`, a pooled-attention's conv pooling), the queries every token; bug
    'swapped': keys and values swapped at the attention."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q_proj = nn.Linear(dim, dim)
        self.kv_proj = nn.Linear(dim, 2 * dim)
        self.pool = nn.Parameter(torch.randn(2 * dim, 1, 2) * 0.5)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q = self.q_proj(x).view(b, n, self.heads, -1).transpose(1, 2)
        kv = F.conv1d(self.kv_proj(x).transpose(1, 2), self.pool, stride=2, groups=2 * c).transpose(1, 2)
        k, v = kv.view(b, -1, 2, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.bug == "swapped":
            k, v = v, k
        o = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, c))


class OneMaskUnit(nn.Module):
    """Hiera-like global attention: a fused qkv laid out `[3, B, heads, 1, N, d]` (one mask unit), the queries
    optionally max-pooled over `q_stride` (`q.view(B, heads, 1, q_stride, -1, d).amax(3)`); bug 'twice': the
    scores scaled twice."""

    def __init__(self, dim: int = 32, heads: int = 4, q_stride: int = 1, bug: str | None = None):
        super().__init__()
        self.heads, self.q_stride, self.bug = heads, q_stride, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        d = C // self.heads
        q, k, v = self.qkv(x).reshape(B, -1, 1, 3, self.heads, d).permute(3, 0, 4, 2, 1, 5).unbind(0)
        if self.q_stride > 1:
            q = q.view(B, self.heads, 1, self.q_stride, -1, d).amax(dim=3)
        attn = (q * d ** -0.5) @ k.transpose(-1, -2)
        if self.bug == "twice":
            attn = attn * d ** -0.5
        x = attn.softmax(dim=-1) @ v  # [B, heads, 1, n_Q, d]
        return self.proj(x.transpose(1, 3).reshape(B, -1, C))


# --- groups of tokens the module makes: after its projections, or padded windows of its norm -----------------------


class StridedUnits(nn.Module):
    """Hiera-like mask unit attention: q, k and v cut into `units` groups after the fused projection, an axis of
    their own beside the heads (`reshape(B, -1, units, 3, heads, d).permute(3, 0, 4, 2, 1, 5)`: token t in unit
    t % units), attention within each unit; bug 'twice': the scores scaled twice."""

    def __init__(self, dim: int = 32, heads: int = 4, units: int = 3, bug: str | None = None):
        super().__init__()
        self.heads, self.units, self.bug = heads, units, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        d = C // self.heads
        q, k, v = self.qkv(x).reshape(B, -1, self.units, 3, self.heads, d).permute(3, 0, 4, 2, 1, 5).unbind(0)
        attn = (q * d ** -0.5) @ k.transpose(-1, -2)  # [B, heads, units, N / units, N / units]
        if self.bug == "twice":
            attn = attn * d ** -0.5
        x = attn.softmax(dim=-1) @ v
        return self.proj(x.transpose(1, 3).reshape(B, -1, C))


class LocalBlocks(nn.Module):
    """Blocked local attention cut after the projections: each head's q, k, v viewed as contiguous blocks of
    `block` tokens, `[b, heads, n_blocks, block, d]`, einsum within each block; bug 'values': v from the key
    projection."""

    def __init__(self, dim: int = 32, heads: int = 4, block: int = 3, bug: str | None = None):
        super().__init__()
        self.heads, self.block, self.bug = heads, block, bug
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        k, v = self.to_kv(x).chunk(2, dim=-1)
        if self.bug == "values":
            v = k
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2).reshape(b, self.heads, n // self.block, self.block, -1)
                   for t in (self.to_q(x), k, v))
        sim = torch.einsum("bhwid,bhwjd->bhwij", q, k) * q.shape[-1] ** -0.5
        out = torch.einsum("bhwij,bhwjd->bhwid", sim.softmax(dim=-1), v)  # [b, heads, n_blocks, block, d]
        return self.to_out(out.reshape(b, self.heads, n, -1).transpose(1, 2).reshape(b, n, c))


class PaddedWindowBlock(nn.Module):
    """SAM-like block on an image `[B, H, W, C]`: norm, windows of `window` tokens a side, the grid padded with zeros
    where no window size divides it (F.pad), attention in each window, the windows folded back and the padding cut,
    the residual; bug 'twice': the scores scaled twice."""

    def __init__(self, dim: int = 32, heads: int = 4, window: int = 2, bug: str | None = None):
        super().__init__()
        self.heads, self.window, self.bug = heads, window, bug
        self.norm = nn.LayerNorm(dim)
        with torch.no_grad():  # a trained norm's gain and shift
            self.norm.weight.copy_(1 + 0.3 * torch.randn(dim))
            self.norm.bias.copy_(0.2 * torch.randn(dim))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, H, W, C = x.shape
        w = self.window
        shortcut, x = x, self.norm(x)
        ph, pw = (w - H % w) % w, (w - W % w) % w
        x = F.pad(x, (0, 0, 0, pw, 0, ph))
        Hp, Wp = H + ph, W + pw
        windows = x.view(B, Hp // w, w, Wp // w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, C)
        n = windows.shape[0]
        q, k, v = self.qkv(windows).reshape(n, w * w, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        if self.bug == "twice":
            attn = attn * q.shape[-1] ** -0.5
        out = self.proj((attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(n, w * w, C))
        out = out.view(B, Hp // w, Wp // w, w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, C)
        return shortcut + out[:, :H, :W]
