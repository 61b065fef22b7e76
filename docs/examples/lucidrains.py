"""Attention as x-transformers and vit-pytorch write it: `to_q` beside one fused `to_kv` chunked into k and v
(`Attention`), or one `to_qkv` chunked in three (`FusedAttention`), heads by reshape and transpose (einops'
`b n (h d) -> b h n d` written out), scores and output by `torch.einsum`. `ScaledTwice` is `Attention` with one
mistake: the scale applied twice. docs/trace.md traces them:

    attnscope trace docs/examples/lucidrains.py:Attention --init "dim=32, heads=4, dim_head=8, causal=True" --causal
    attnscope trace docs/examples/lucidrains.py:FusedAttention --init "dim=32, heads=4, dim_head=8"
    attnscope trace docs/examples/lucidrains.py:ScaledTwice --init "dim=32, heads=4, dim_head=8"   # exit 1
"""
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, causal=False):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.causal = causal
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def split_heads(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, self.heads, -1).transpose(1, 2)  # b n (h d) -> b h n d

    def forward(self, x):
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = map(self.split_heads, (q, k, v))
        dots = torch.einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        if self.causal:
            i, j = dots.shape[-2:]
            causal_mask = torch.ones(i, j, dtype=torch.bool, device=x.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, -torch.finfo(dots.dtype).max)
        attn = dots.softmax(dim=-1)
        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)
        b, h, n, d = out.shape
        out = out.transpose(1, 2).reshape(b, n, h * d)  # b h n d -> b n (h d)
        return self.to_out(out)


class FusedAttention(Attention):
    def __init__(self, dim, heads=8, dim_head=64):
        super().__init__(dim, heads, dim_head)
        del self.to_q, self.to_kv
        self.to_qkv = nn.Linear(dim, dim_head * heads * 3, bias=False)

    def forward(self, x):
        q, k, v = map(self.split_heads, self.to_qkv(x).chunk(3, dim=-1))
        dots = torch.einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        attn = dots.softmax(dim=-1)
        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)
        b, h, n, d = out.shape
        return self.to_out(out.transpose(1, 2).reshape(b, n, h * d))


class ScaledTwice(Attention):
    def forward(self, x):
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = map(self.split_heads, (q, k, v))
        dots = torch.einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        attn = (dots * self.scale).softmax(dim=-1)  # the scale again
        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)
        b, h, n, d = out.shape
        return self.to_out(out.transpose(1, 2).reshape(b, n, h * d))
