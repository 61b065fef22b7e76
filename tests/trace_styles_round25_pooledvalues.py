"""Keys and values pooled on each head's grid of tokens after a fused projection, and the plant that pools the keys'
projection for the values too: an MViTv2-like block (detectron2's `attention_pool`, a depthwise strided Conv2d and a
LayerNorm of each head, [B·heads, H, W, d] grids, residual pooling), an MViTv1-like one (nn.MaxPool2d over
[B·heads, d, H, W]), and a functional one with F.adaptive_avg_pool2d over each head's grid laid out as [B, heads,
d, H, W]. The image comes in as [B, H, W, C]."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from _trace_ref import trained


def _pool(x, pool, norm=None):
    """[B·heads, H, W, d] -> pooled [B·heads, H', W', d], its tokens normed."""
    x = pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    return norm(x) if norm is not None else x


class MViTv2Attention(nn.Module):
    def __init__(self, dim=32, heads=4, stride_kv=2, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        d = dim // heads
        self.scale = d ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.pool_k = nn.Conv2d(d, d, 3, stride=stride_kv, padding=1, groups=d, bias=False)
        self.pool_v = nn.Conv2d(d, d, 3, stride=stride_kv, padding=1, groups=d, bias=False)
        self.norm_k, self.norm_v = nn.LayerNorm(d), nn.LayerNorm(d)
        trained(self, 23)

    def forward(self, x):
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H, W, 3, self.heads, -1).permute(3, 0, 4, 1, 2, 5)  # [3, B, heads, H, W, d]
        q, k, v = qkv.reshape(3, B * self.heads, H, W, -1).unbind(0)
        k_grid = k
        k = _pool(k, self.pool_k, self.norm_k)
        v = _pool(k_grid if self.bug == "values_from_keys" else v, self.pool_v, self.norm_v)
        hw = q.shape[1:3]
        q, k, v = (t.reshape(t.shape[0], -1, t.shape[-1]) for t in (q, k, v))
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        out = (attn @ v).view(B, self.heads, hw[0], hw[1], -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        return self.proj(out)


class MViTv1Attention(nn.Module):
    """Keys and values max-pooled (stride 2) on each head's grid, the queries not pooled."""

    def __init__(self, dim=24, heads=3, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        trained(self, 23)

    def forward(self, x):
        B, H, W, C = x.shape
        d = C // self.heads
        q, k, v = self.qkv(x.reshape(B, H * W, C)).reshape(B, H * W, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        grids = [t.reshape(B * self.heads, H, W, d).permute(0, 3, 1, 2) for t in (k, v)]  # [B·heads, d, H, W]
        k = self.pool(grids[0]).flatten(2).transpose(1, 2).reshape(B, self.heads, -1, d)
        v = self.pool(grids[0] if self.bug == "values_from_keys" else grids[1])
        v = v.flatten(2).transpose(1, 2).reshape(B, self.heads, -1, d)
        out = F.scaled_dot_product_attention(q, k, v)  # [B, heads, H·W, d]
        return self.proj(out.transpose(1, 2).reshape(B, H, W, C))


def pooled_attention(x, w_qkv, b_qkv, w_out, b_out, heads, size=2, bug=None):
    """Functional: keys and values averaged to a size × size grid per head (F.adaptive_avg_pool2d over [B·heads, d,
    H, W]), einsum scores."""
    B, H, W, C = x.shape
    d = C // heads
    qkv = F.linear(x, w_qkv, b_qkv).view(B, H, W, 3, heads, d)
    q, k, v = (qkv[:, :, :, i].permute(0, 3, 4, 1, 2) for i in range(3))  # [B, heads, d, H, W]
    k_avg = F.adaptive_avg_pool2d(k.reshape(B * heads, d, H, W), size).view(B, heads, d, -1)
    v_avg = F.adaptive_avg_pool2d((k if bug == "values_from_keys" else v).reshape(B * heads, d, H, W), size)
    v_avg = v_avg.view(B, heads, d, -1)
    scores = torch.einsum("bhdq,bhdk->bhqk", q.reshape(B, heads, d, H * W), k_avg) * d ** -0.5
    out = torch.einsum("bhqk,bhdk->bqhd", scores.softmax(-1), v_avg).reshape(B, H, W, C)
    return F.linear(out, w_out, b_out)


class AvgPooledAttention(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.w_qkv = nn.Parameter(torch.randn(3 * dim, dim) / dim ** 0.5)
        self.b_qkv = nn.Parameter(0.1 * torch.randn(3 * dim))
        self.w_out = nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)
        self.b_out = nn.Parameter(0.1 * torch.randn(dim))
        trained(self, 23)

    def forward(self, x):
        return pooled_attention(x, self.w_qkv, self.b_qkv, self.w_out, self.b_out, self.heads, bug=self.bug)
