"""Inputs, queries, keys and values of other shapes than [n_batch, n, d_feat] (docs/trace.md, "An image, some
tokens, pooled keys: other shapes from the one input"): SAM's image-encoder attention, which takes an image
[B, H, W, C]; CaiT's class attention, whose queries are the class token alone; Linformer's keys and values
projected along the sequence after their projections. `bug=` plants a mistake:

    attnscope trace docs/examples/shapes.py:ImageAttention
    attnscope trace docs/examples/shapes.py:ClassAttention --init "bug='twice'"
    attnscope trace docs/examples/shapes.py:Linformer --nq 8
"""

import torch
import torch.nn as nn


class ImageAttention(nn.Module):
    """SAM's `Attention` (segment_anything/modeling/image_encoder.py) without its relative positions."""

    def __init__(self, dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.scale, self.bug = num_heads, (dim // num_heads) ** -0.5, bug
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * self.num_heads, H * W, -1).unbind(0)  # [B·heads, H·W, d_head] each
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        x = (attn @ v).view(B, self.num_heads, H, W, -1)
        x = x.reshape(B, H, W, -1) if self.bug == "merge" else x.permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        return self.proj(x)


class ClassAttention(nn.Module):
    """timm's CaiT `ClassAttn`: the queries from the class token, `self.q(x[:, 0])`."""

    def __init__(self, dim=32, num_heads=4, bug=None):
        super().__init__()
        self.num_heads, self.scale, self.bug = num_heads, (dim // num_heads) ** -0.5, bug
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q = self.q(x[:, 0]).unsqueeze(1).reshape(B, 1, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        k = self.k(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        v = self.v(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if self.bug == "twice":
            attn = attn * self.scale
        x_cls = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, 1, C)
        return self.proj(x_cls)


class Linformer(nn.Module):
    """lucidrains' `LinformerSelfAttention`: keys and values projected along the sequence, n_K = k."""

    def __init__(self, dim=32, seq_len=8, k=4, heads=4):
        super().__init__()
        self.k, self.heads, self.dim_head = k, heads, dim // heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.proj_k = nn.Parameter(torch.randn(seq_len, k) / k ** 0.5)
        self.proj_v = nn.Parameter(torch.randn(seq_len, k) / k ** 0.5)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        queries = self.to_q(x).reshape(b, n, self.heads, -1).transpose(1, 2)
        keys = torch.einsum("bnd,nk->bkd", self.to_k(x), self.proj_k[:n])
        values = torch.einsum("bnd,nk->bkd", self.to_v(x), self.proj_v[:n])
        keys, values = (t.reshape(b, self.k, -1, self.dim_head).transpose(1, 2) for t in (keys, values))
        dots = torch.einsum("bhnd,bhkd->bhnk", queries, keys) * self.dim_head ** -0.5
        out = torch.einsum("bhnk,bhkd->bhnd", dots.softmax(dim=-1), values)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class CompressedLinear(nn.Module):
    """rtdl's FT-Transformer with kv_compression_ratio: the projected keys and values each compressed along the
    tokens by an nn.Linear of its own, n -> n / 2 (docs/trace.md, "Queries, keys or values pooled after their
    projection"). bug="values_from_keys": the values are the compressed keys.

        attnscope trace docs/examples/shapes.py:CompressedLinear --init "bug='values_from_keys'" --nq 8
    """

    def __init__(self, dim=32, heads=4, n_tokens=8, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.W_q, self.W_k, self.W_v, self.W_out = (nn.Linear(dim, dim) for _ in range(4))
        self.key_compression = nn.Linear(n_tokens, n_tokens // 2, bias=False)
        self.value_compression = nn.Linear(n_tokens, n_tokens // 2, bias=False)

    def forward(self, x):
        q, k, v = self.W_q(x), self.W_k(x), self.W_v(x)
        k = self.key_compression(k.transpose(1, 2)).transpose(1, 2)  # [b, n / 2, dim]
        v = k if self.bug == "values_from_keys" else self.value_compression(v.transpose(1, 2)).transpose(1, 2)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        out = torch.softmax(q @ k.transpose(-2, -1) / k.size(-1) ** 0.5, dim=-1) @ v  # [b, heads, n, d_head]
        return self.W_out(out.transpose(1, 2).flatten(2))


class PooledGrid(nn.Module):
    """MViTv2-like pooling attention on an image [B, H, W, C]: a fused qkv, each head's q, k and v pooled by a
    depthwise nn.Conv2d (q with stride 1, k and v with stride 2) and a LayerNorm, the pooled queries added back to
    each head's output (residual pooling) (docs/trace.md, "Each head's tokens a grid, pooled on both sides").

        attnscope trace docs/examples/shapes.py:PooledGrid --nq 36
    """

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, d, self.bug = heads, dim // heads, bug
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.pool_q, self.pool_k, self.pool_v = (nn.Conv2d(d, d, 3, s, 1, groups=d, bias=False) for s in (1, 2, 2))
        self.norm_q, self.norm_k, self.norm_v = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        b, h, w, _ = x.shape
        qkv = self.qkv(x).reshape(b, h, w, 3, self.heads, -1).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv.reshape(3, b * self.heads, h, w, -1).unbind(0)  # [b·heads, h, w, d_head]
        q, k, v = (norm(pool(t.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)) for t, pool, norm in
                   ((q, self.pool_q, self.norm_q), (k, self.pool_k, self.norm_k), (k if self.bug else v, self.pool_v, self.norm_v)))
        hq, wq = q.shape[1:3]
        q, k, v = (t.flatten(1, 2) for t in (q, k, v))  # [b·heads, n, d_head]
        out = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v + q
        out = out.view(b, self.heads, hq, wq, -1).permute(0, 2, 3, 1, 4).reshape(b, hq, wq, -1)
        return self.proj(out)
