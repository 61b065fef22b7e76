"""Attention whose keys and values come from a shorter sequence the module computes from its input (round 20's
reduced sequence), for tests/test_trace_round20_seqreduce.py. Each takes `bug=None` or a planted mistake trace names
by experiment: `no_scale`, `scale_twice` (`scale_d_head` where SDPA is handed 1/d_head), `scale_d_model` (the
scores divided by √(n_head·d_head)), `softmax_axis` (over the queries), `kv_swapped` (the weighted sum over the
keys, the scores against the values), `values_from_keys` (the values made by the keys' projection before the
reduction), `merge_no_transpose` (the heads' outputs viewed back without moving the heads behind the tokens),
`split_no_permute` (the queries viewed into heads without moving the heads before the tokens).

- `EinsumLinformer`: lucidrains' linformer: `proj_k`/`proj_v` Parameters `[seq_len, k]` applied along the sequence by
  `einsum('bnd,nk->bkd')`, `share_kv` reusing the keys' projection and its E for the values, `one_kv_head` one head of
  keys and values expanded over the query heads; einsum scores.
- `LinearLinformer`: a Linformer written with `nn.Linear(seq_len, k)` over the projections laid out with the tokens
  last (`k.transpose(1, 2)`), q @ kᵀ scores, a fused qkv Linear chunked in three.
- `HeadwiseLinformer`: Linformer's headwise sharing: one E `[seq_len, k]` for the keys and the values of every head,
  applied after the split by `einsum('bhnd,nk->bhkd')`, the attention by SDPA.
- `MatmulLinformer`: E and F as Parameters in matmuls, `(k.transpose(1, 2) @ E).transpose(1, 2)` and `F.t() @ v`.
- `CompressedInput`: the input itself compressed along the sequence before the key and value projections, by a
  `nn.Linear(seq_len, k)` over `x.transpose(1, 2)` or (`by_param=True`) a Parameter in `einsum('bnd,nk->bkd', x, E)`.
- `EfficientSelfAttention`: Segformer's and PVT's: the keys' and values' input a strided Conv2d over the tokens laid
  out as an image then a LayerNorm, kv = Linear(C, 2C) split by reshape/permute, heads first.
- `PooledKV`: keys and values avg-pooled along the sequence after their projection, per head (`F.avg_pool2d` over the
  tokens), SDPA.
- `AdaptivePoolKV`: PVTv2's linear mode: the input laid out as an image, `AdaptiveAvgPool2d`, a 1x1 Conv2d, a
  LayerNorm and a GELU, then separate key and value Linears.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _grown(module, seed):
    """Move every weight off its initial value, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


def _scaled(dots, d_head, n_head, bug):
    if bug == "no_scale":
        return dots
    if bug == "scale_twice":
        return dots * d_head ** -0.5 * d_head ** -0.5
    if bug == "scale_d_model":
        return dots * (d_head * n_head) ** -0.5
    return dots * d_head ** -0.5


class EinsumLinformer(nn.Module):
    def __init__(self, dim=24, seq_len=10, k=4, heads=3, dim_head=None, share_kv=False, one_kv_head=False, bug=None):
        super().__init__()
        self.seq_len, self.k, self.heads = seq_len, k, heads
        dim_head = dim_head or dim // heads
        self.dim_head, self.share_kv, self.bug = dim_head, share_kv, bug
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        kv_dim = dim_head if one_kv_head else dim_head * heads
        self.to_k = nn.Linear(dim, kv_dim, bias=False)
        self.proj_k = nn.Parameter(torch.zeros(seq_len, k).uniform_(-1 / math.sqrt(k), 1 / math.sqrt(k)))
        if not share_kv:
            self.to_v = nn.Linear(dim, kv_dim, bias=False)
            self.proj_v = nn.Parameter(torch.zeros(seq_len, k).uniform_(-1 / math.sqrt(k), 1 / math.sqrt(k)))
        self.to_out = nn.Linear(dim_head * heads, dim)
        _grown(self, 11)

    def forward(self, x):
        b, n, d = x.shape
        d_h, h, k = self.dim_head, self.heads, self.k
        queries = self.to_q(x)
        keys = self.to_k(x)
        if self.share_kv:
            values = keys
        elif self.bug == "values_from_keys":
            values = keys
        else:
            values = self.to_v(x)
        kv_projs = (self.proj_k, self.proj_v if not self.share_kv else self.proj_k)
        if n < self.seq_len:  # a shorter input reads the first rows of the projections along the sequence
            kv_projs = tuple(p[:n] for p in kv_projs)
        keys, values = (torch.einsum("bnd,nk->bkd", t, p) for t, p in zip((keys, values), kv_projs, strict=True))
        if self.bug == "split_no_permute":
            queries = queries.reshape(b, h, n, -1)
        else:
            queries = queries.reshape(b, n, h, -1).transpose(1, 2)
        keys, values = (t.reshape(b, k, -1, d_h).transpose(1, 2).expand(-1, h, -1, -1) for t in (keys, values))
        if self.bug == "kv_swapped":
            keys, values = values, keys
        dots = _scaled(torch.einsum("bhnd,bhkd->bhnk", queries, keys), d_h, h, self.bug)
        attn = dots.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.einsum("bhnk,bhkd->bhnd", attn, values)
        if self.bug == "merge_no_transpose":
            out = out.reshape(b, n, -1)
        else:
            out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class LinearLinformer(nn.Module):
    def __init__(self, d_model=32, n_heads=4, max_len=8, proj_len=3, bug=None):
        super().__init__()
        self.h, self.d_k, self.bug = n_heads, d_model // n_heads, bug
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.E = nn.Linear(max_len, proj_len)
        self.F = nn.Linear(max_len, proj_len)
        self.out = nn.Linear(d_model, d_model)
        _grown(self, 12)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.bug == "values_from_keys":
            v = k
        k = self.E(k.transpose(1, 2)).transpose(1, 2)  # [B, proj_len, C]
        v = self.F(v.transpose(1, 2)).transpose(1, 2)
        if self.bug == "split_no_permute":
            q = q.reshape(B, self.h, T, self.d_k)
        else:
            q = q.view(B, T, self.h, self.d_k).transpose(1, 2)
        k = k.view(B, -1, self.h, self.d_k).transpose(1, 2)
        v = v.view(B, -1, self.h, self.d_k).transpose(1, 2)
        if self.bug == "kv_swapped":
            k, v = v, k
        scores = _scaled(q @ k.transpose(-2, -1), self.d_k, self.h, self.bug)
        w = F.softmax(scores, dim=-2 if self.bug == "softmax_axis" else -1)
        y = w @ v
        if self.bug == "merge_no_transpose":
            y = y.contiguous().view(B, T, C)
        else:
            y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.out(y)


class EfficientSelfAttention(nn.Module):
    def __init__(self, dim=32, num_heads=2, sr_ratio=2, qkv_bias=True, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
        self.norm = nn.LayerNorm(dim)
        _grown(self, 13)

    def forward(self, x, H, W):
        B, N, C = x.shape
        h, d = self.num_heads, C // self.num_heads
        q = self.q(x)
        if self.bug == "split_no_permute":
            q = q.reshape(B, h, N, d)
        else:
            q = q.reshape(B, N, h, d).permute(0, 2, 1, 3)
        x_ = x.permute(0, 2, 1).reshape(B, C, H, W)
        x_ = self.sr(x_).reshape(B, C, -1).permute(0, 2, 1)
        x_ = self.norm(x_)
        kv = self.kv(x_).reshape(B, -1, 2, h, d).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        if self.bug == "values_from_keys":
            v = k
        if self.bug == "kv_swapped":
            k, v = v, k
        attn = _scaled(q @ k.transpose(-2, -1), d, h, self.bug)
        attn = attn.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = attn @ v
        if self.bug == "merge_no_transpose":
            out = out.reshape(B, N, C)
        else:
            out = out.transpose(1, 2).reshape(B, N, C)
        return self.proj(out)


class PooledKV(nn.Module):
    def __init__(self, embed_dim=24, num_heads=2, pool=2, bug=None):
        super().__init__()
        self.num_heads, self.pool, self.bug = num_heads, pool, bug
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.o_proj = nn.Linear(embed_dim, embed_dim)
        _grown(self, 14)

    def forward(self, hidden_states):
        B, N, E = hidden_states.shape
        h = self.num_heads
        d = E // h

        def shape(t):
            return t.view(B, -1, h, d).transpose(1, 2)

        q = shape(self.q_proj(hidden_states))
        k = shape(self.k_proj(hidden_states))
        v = shape(self.v_proj(hidden_states) if self.bug != "values_from_keys" else self.k_proj(hidden_states))
        k = F.avg_pool2d(k, kernel_size=(self.pool, 1), stride=(self.pool, 1))
        v = F.avg_pool2d(v, kernel_size=(self.pool, 1), stride=(self.pool, 1))
        if self.bug == "kv_swapped":
            k, v = v, k
        scale = {"no_scale": 1.0, "scale_d_head": 1.0 / d, "scale_d_model": E ** -0.5}.get(self.bug, d ** -0.5)
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        if self.bug == "merge_no_transpose":
            out = out.reshape(B, N, E)
        else:
            out = out.transpose(1, 2).reshape(B, N, E)
        return self.o_proj(out)


class AdaptivePoolKV(nn.Module):
    def __init__(self, dim=32, num_heads=4, pool_size=2, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.scale = (dim // num_heads) ** -0.5
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.pool = nn.AdaptiveAvgPool2d(pool_size)
        self.sr = nn.Conv2d(dim, dim, kernel_size=1, stride=1)
        self.norm = nn.LayerNorm(dim)
        self.act = nn.GELU()
        self.proj = nn.Linear(dim, dim)
        _grown(self, 15)

    def forward(self, x, H, W):
        B, N, C = x.shape
        h, d = self.num_heads, C // self.num_heads
        q = self.q(x).reshape(B, N, h, d).permute(0, 2, 1, 3)
        x_ = x.permute(0, 2, 1).reshape(B, C, H, W)
        x_ = self.sr(self.pool(x_)).reshape(B, C, -1).permute(0, 2, 1)
        x_ = self.act(self.norm(x_))
        k = self.k(x_).reshape(B, -1, h, d).permute(0, 2, 1, 3)
        v = (self.k if self.bug == "values_from_keys" else self.v)(x_).reshape(B, -1, h, d).permute(0, 2, 1, 3)
        if self.bug == "kv_swapped":
            k, v = v, k
        attn = _scaled(q @ k.transpose(-2, -1), d, h, self.bug)
        attn = attn.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        x = attn @ v
        if self.bug == "merge_no_transpose":
            x = x.reshape(B, N, C)
        else:
            x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class HeadwiseLinformer(nn.Module):
    def __init__(self, d_model=32, n_heads=4, max_len=12, k=5, bug=None):
        super().__init__()
        self.h, self.bug = n_heads, bug
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d_model, d_model, bias=False)
                                                                for _ in range(4))
        self.E = nn.Parameter(torch.randn(max_len, k) / k ** 0.5)
        _grown(self, 16)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.h, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.bug == "values_from_keys":
            v = k
        k = torch.einsum("bhnd,nk->bhkd", k, self.E)
        v = torch.einsum("bhnd,nk->bhkd", v, self.E)
        if self.bug == "kv_swapped":
            k, v = v, k
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 if self.bug == "no_scale" else None)
        if self.bug == "merge_no_transpose":
            return self.out_proj(out.reshape(b, n, d))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class MatmulLinformer(nn.Module):
    def __init__(self, d=24, h=3, n=10, k=4, bug=None):
        super().__init__()
        self.h, self.bug = h, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))
        self.E = nn.Parameter(torch.randn(n, k) / k ** 0.5)
        self.F = nn.Parameter(torch.randn(n, k) / k ** 0.5)
        _grown(self, 17)

    def forward(self, x):
        b, n, d = x.shape
        q, k = self.wq(x), self.wk(x)
        v = k if self.bug == "values_from_keys" else self.wv(x)
        k = (k.transpose(1, 2) @ self.E).transpose(1, 2)
        v = torch.matmul(self.F.t(), v)
        q, k, v = (t.view(b, -1, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        if self.bug == "kv_swapped":
            k, v = v, k
        s = _scaled(q @ k.transpose(-1, -2), d // self.h, self.h, self.bug)
        out = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
        return self.wo(out)


class CompressedInput(nn.Module):
    def __init__(self, d=24, h=3, n=10, k=4, by_param=False, bug=None):
        super().__init__()
        self.h, self.by_param, self.bug = h, by_param, bug
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        if by_param:
            self.E = nn.Parameter(torch.randn(n, k) / k ** 0.5)
        else:
            self.compress = nn.Linear(n, k)
        _grown(self, 18)

    def forward(self, x):
        b, n, d = x.shape
        if self.by_param:
            m = torch.einsum("bnd,nk->bkd", x, self.E)
        else:
            m = self.compress(x.transpose(1, 2)).transpose(1, 2)
        q = self.q(x).view(b, n, self.h, -1).transpose(1, 2)
        k = self.k(m).view(b, -1, self.h, d // self.h).transpose(1, 2)
        v = (self.k if self.bug == "values_from_keys" else self.v)(m).view(b, -1, self.h, d // self.h).transpose(1, 2)
        if self.bug == "kv_swapped":
            k, v = v, k
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 if self.bug == "no_scale" else None)
        return self.o(out.transpose(1, 2).reshape(b, n, d))
