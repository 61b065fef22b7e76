"""Styles for tests/test_trace_r14_convproj.py: each of q, k and v read through a tensor of its own the module makes
from its input (a convolution, a norm or a pooling before the role's Linear), written the way their libraries write
them, at tiny sizes, without einops.

- ConvProjection: CvT's `Attention` (a depthwise Conv2d + BatchNorm2d per role over the tokens laid out as an image,
  the keys' and values' with stride 2, the class token kept aside and joined back, proj_q/proj_k/proj_v, einsum
  with a list of operands, `* self.scale`); method="avg": the queries' tokens as they are, parameter-free AvgPool2d
  keys and values.
- SeparableConvProjection: a sequence form (MobileViT/Conformer-like): `x.transpose(1, 2)` through a depthwise
  Conv1d per role (the keys' and values' strided), a LayerNorm each, to_q/to_k/to_v, explicit matmul and softmax,
  no class token.
- PooledQueriesKeys: the queries through a depthwise Conv2d with a bias (no norm), the keys and values through one
  max pool each and a LayerNorm of their own (MaxViT/CoAtNet-like downsampled keys), SDPA.
"""

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
        for name, b in module.named_buffers():  # a BatchNorm's running statistics, as training leaves them
            if name.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
            elif name.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    return module


class ConvProjection(nn.Module):
    def __init__(self, dim_in=32, dim_out=32, num_heads=4, method="dw_bn", attn_drop=0.0, bug=None):
        super().__init__()
        self.num_heads, self.bug, self.p = num_heads, bug, attn_drop
        self.scale = (dim_out // num_heads) ** -0.5
        self.conv_proj_q = self._projection(dim_in, 1, "linear" if method == "avg" else method)
        self.conv_proj_k = self._projection(dim_in, 2, method)
        self.conv_proj_v = self._projection(dim_in, 2, method)
        self.proj_q = nn.Linear(dim_in, dim_out, bias=False)
        self.proj_k = nn.Linear(dim_in, dim_out, bias=False)
        self.proj_v = nn.Linear(dim_in, dim_out, bias=False)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim_out, dim_out)
        _trained(self, 3)

    @staticmethod
    def _projection(dim, stride, method):
        if method == "dw_bn":
            return nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, stride=stride, bias=False, groups=dim),
                                 nn.BatchNorm2d(dim))
        if method == "avg":
            return nn.AvgPool2d(3, padding=1, stride=stride, ceil_mode=True)
        return None

    def forward_conv(self, x, h, w):
        cls_token, x = torch.split(x, [1, h * w], 1)
        b, _, c = x.shape
        image = x.transpose(1, 2).reshape(b, c, h, w)
        out = []
        for conv in (self.conv_proj_q, self.conv_proj_k, self.conv_proj_v):
            made = image.flatten(2).transpose(1, 2) if conv is None else conv(image).flatten(2).transpose(1, 2)
            out.append(torch.cat((cls_token, made), dim=1))
        return out

    def forward(self, x, h, w):
        q, k, v = self.forward_conv(x, h, w)
        b = x.shape[0]
        q, k, v = (f(t).reshape(b, t.shape[1], self.num_heads, -1).permute(0, 2, 1, 3)
                   for f, t in ((self.proj_q, q), (self.proj_k, k), (self.proj_v, v)))
        attn_score = torch.einsum("bhlk,bhtk->bhlt", [q, k])
        if self.bug != "scale_none":
            attn_score = attn_score * self.scale
        attn = F.softmax(attn_score, dim=-1)
        attn = F.dropout(attn, p=self.p) if self.bug == "dropout_on" else self.attn_drop(attn)
        x = torch.einsum("bhlt,bhtv->bhlv", [attn, v])
        if self.bug == "merge_no_transpose":
            x = x.reshape(b, x.shape[2], -1)
        else:
            x = x.permute(0, 2, 1, 3).reshape(b, x.shape[2], -1)
        return self.proj(x)


class SeparableConvProjection(nn.Module):
    def __init__(self, dim=32, heads=4, stride=2, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q_conv = nn.Conv1d(dim, dim, 3, padding=1, groups=dim)
        self.k_conv = nn.Conv1d(dim, dim, 3, padding=1, stride=stride, groups=dim)
        self.v_conv = nn.Conv1d(dim, dim, 3, padding=1, stride=stride, groups=dim)
        self.q_norm, self.k_norm, self.v_norm = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        _trained(self, 5)

    def forward(self, x):
        b, n, d = x.shape
        seq = x.transpose(1, 2)
        q = self.q_norm(self.q_conv(seq).transpose(1, 2))
        k = self.k_norm(self.k_conv(seq).transpose(1, 2))
        v = self.v_norm(self.v_conv(seq).transpose(1, 2))
        q, k, v = self.to_q(q), self.to_k(k), self.to_v(v)
        if self.bug == "kv_swapped":
            k, v = v, k
        q, k, v = (t.view(b, -1, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        attn = scores.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.matmul(attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class PooledQueriesKeys(nn.Module):
    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q_dw = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.k_norm, self.v_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim)
        _trained(self, 9)

    def forward(self, x, size=(4, 4)):
        b, n, d = x.shape
        image = x.transpose(1, 2).reshape(b, d, *size)
        q = self.q_dw(image).flatten(2).transpose(1, 2)
        k = self.k_norm(F.max_pool2d(image, 2).flatten(2).transpose(1, 2))
        v = self.v_norm(F.max_pool2d(image, 2).flatten(2).transpose(1, 2))
        q, k, v = (t.reshape(b, -1, self.heads, d // self.heads).transpose(1, 2)
                   for t in (self.wq(q), self.wk(k), self.wv(v)))
        scale = d ** -0.5 if self.bug == "scale_d_model" else None
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        if self.bug == "merge_no_transpose":
            return self.wo(out.reshape(b, n, d))
        return self.wo(out.transpose(1, 2).reshape(b, n, d))
