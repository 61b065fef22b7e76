"""Stable Diffusion's CrossAttention (CompVis/stable-diffusion, ldm/modules/attention.py), its einops `rearrange`
written out in torch: to_q reads query_dim features, to_k and to_v context_dim, the heads folded into the batch
(`b n (h d) -> (b h) n d`); run alone, `context = default(context, x)` makes it self-attention. docs/trace.md
traces it:

    attnscope trace docs/examples/stable_diffusion.py:CrossAttention --init "query_dim=32, context_dim=16, heads=4, dim_head=8"
"""
import torch
from torch import einsum, nn


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = default(context_dim, query_dim)
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None):
        h = self.heads
        q = self.to_q(x)
        context = default(context, x)
        k = self.to_k(context)
        v = self.to_v(context)
        q, k, v = (fold_heads(t, h) for t in (q, k, v))  # b n (h d) -> (b h) n d
        sim = einsum("b i d, b j d -> b i j", q, k) * self.scale
        if exists(mask):
            mask = mask.reshape(mask.shape[0], -1)  # b ... -> b (...)
            max_neg_value = -torch.finfo(sim.dtype).max
            mask = mask.repeat_interleave(h, dim=0)[:, None, :]  # b j -> (b h) () j
            sim.masked_fill_(~mask, max_neg_value)
        attn = sim.softmax(dim=-1)
        out = einsum("b i j, b j d -> b i d", attn, v)
        b = out.shape[0] // h
        out = out.reshape(b, h, *out.shape[1:]).permute(0, 2, 1, 3).reshape(b, out.shape[1], -1)  # (b h) n d -> b n (h d)
        return self.to_out(out)


def fold_heads(t, h):
    b, n, _ = t.shape
    return t.reshape(b, n, h, -1).permute(0, 2, 1, 3).reshape(b * h, n, -1)
