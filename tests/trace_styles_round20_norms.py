"""Query/key norms in the places and forms real code puts them, and head counts kept under names of the code's own,
for tests/test_trace_round20_norms.py. Each takes `bug=None`; the plants are listed per class.

- `ProjNormAttention`: OLMo 2's idiom written otherwise: Linear layers `query`, `key`, `value`, `dense`, a hand-written
  RMSNorm over the whole projection (computed in float32, its weight `scale`) before the head split, interleaved
  RoPE by a complex product on `[b, n, h, d]` (rotate_half with `half=True`), GQA by `repeat_interleave`, an eager
  softmax. Plants: `norm_late` (the norm over the whole rotated projection, after RoPE), `per_head` (each head's
  RMS, the projection's weight), `norm_v` (the values normed too, by the keys' norm), `no_k_norm`, `kv_swapped`.
- `HeadGridNorm`: `nn.LayerNorm((n_head, d_head))` on `[b, n, h, d]` (one mean over the whole projection, a 2-D
  weight and bias), then rotate_half RoPE on `[b, h, n, d]` and SDPA. Plants: `norm_late`, `no_k_norm`, `kv_swapped`,
  `per_head` (`F.layer_norm` over d_head alone, the grid's weight and bias).
- `L2NormLayer`: Llama 4's weightless qk L2 norm (`x * rsqrt(mean(x²) + eps)`) on the rotated heads, the layer with
  RoPE (`rope=True`) or a NoPE layer (no RoPE and no norm), `[b, n, h, d]` einsum scores, GQA. Plants: `no_k_norm`,
  `norm_v`, `tiled` (the key/value heads repeated with `.repeat`), `no_scale`.
- `GemmaHeads`: Gemma 3's RMSNorm with `(1 + weight)` (float32) on q and k heads before rotate_half RoPE, scale
  `query_pre_attn_scalar ** -0.5` (a config's number, not d_head's), GQA through `enable_gqa`. Plants: `norm_late`,
  `scale_dhead` (`d_head ** -0.5`), `kv_swapped`, `no_k_norm`, `whole` (each token's mean over every head's
  coordinates, `mean((1, 3))`), `norm_v`.
- `JointNorms`: SD3's MMDiT joint attention: image tokens and context tokens each projected, split into heads, an
  RMSNorm per head on q and k of each stream (`norm_q`, `norm_k`, `norm_added_q`, `norm_added_k`), joined along the
  sequence, SDPA, split back, each stream's output projection. Plants: `no_k_norm`, `norm_v`, `kv_swapped`.
- `CachedHeads`: a head count kept as `self.h` (no `n_head`/`num_heads` anywhere), a per-head `nn.RMSNorm`, a KV
  cache taken as `past_kv=(k, v)`. Plants: `no_k_norm`, `kv_swapped`, `norm_v`.
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
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _inv_freq(d, base=10000.0):
    return 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d / 2]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _half_rope(x, start=0):
    """x `[b, h, n, d]`, rotate_half RoPE from cos/sin tables."""
    n, d = x.shape[-2], x.shape[-1]
    ang = torch.outer(torch.arange(start, start + n, dtype=torch.float64), _inv_freq(d))
    emb = torch.cat((ang, ang), -1).to(x.dtype)
    return x * emb.cos() + _rotate_half(x) * emb.sin()


def _complex_rope(x):
    """x `[b, n, h, d]`, Meta's interleaved pairs turned by a complex product."""
    n, d = x.shape[1], x.shape[-1]
    freqs = torch.polar(torch.ones(n, d // 2, dtype=torch.float64),
                        torch.outer(torch.arange(n, dtype=torch.float64), _inv_freq(d)))  # [n, d / 2]
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs[None, :, None, :]).flatten(3).type_as(x)


class ScaleRMSNorm(nn.Module):
    """An RMSNorm of one's own, in float32, its gain `scale`."""

    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.scale.float()).to(dtype)


class ProjNormAttention(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, half=False, bug=None):
        super().__init__()
        self.bug, self.half, self.heads, self.kv_heads, self.head_dim = bug, half, heads, kv_heads, dim // heads
        self.query = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.key = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.value = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.dense = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.q_ln = ScaleRMSNorm(heads * self.head_dim)
        self.k_ln = ScaleRMSNorm(kv_heads * self.head_dim)
        _grown(self, 11)

    def _per_head(self, t, norm):
        """each head's own RMS, the whole projection's gain."""
        heads = t.unflatten(-1, (-1, self.head_dim))
        normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + norm.eps)
        return normed.flatten(-2) * norm.scale

    def forward(self, x):
        b, n, _ = x.shape
        keys, values = (self.value, self.key) if self.bug == "kv_swapped" else (self.key, self.value)
        q, k, v = self.query(x), keys(x), values(x)
        if self.bug == "per_head":
            q, k = self._per_head(q, self.q_ln), self._per_head(k, self.k_ln)
        elif self.bug != "norm_late":
            q = self.q_ln(q)
            k = k if self.bug == "no_k_norm" else self.k_ln(k)
        if self.bug == "norm_v":
            v = self.k_ln(v)
        q = q.view(b, n, self.heads, self.head_dim)  # [b, n, h, d]
        k = k.view(b, n, self.kv_heads, self.head_dim)
        v = v.view(b, n, self.kv_heads, self.head_dim)
        if self.half:  # rotate_half on [b, h, n, d]
            q, k = _half_rope(q.transpose(1, 2)).transpose(1, 2), _half_rope(k.transpose(1, 2)).transpose(1, 2)
        else:
            q, k = _complex_rope(q), _complex_rope(k)
        if self.bug == "norm_late":
            q = self.q_ln(q.flatten(2)).view(b, n, self.heads, self.head_dim)
            k = self.k_ln(k.flatten(2)).view(b, n, self.kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, h, n, d]
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # [b, h, n, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = scores.softmax(-1) @ v  # [b, h, n, d]
        return self.dense(out.transpose(1, 2).reshape(b, n, -1))


class HeadGridNorm(nn.Module):
    def __init__(self, dim=32, n_heads=4, bug=None):
        super().__init__()
        self.bug, self.n_heads, self.d = bug, n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)
        self.q_norm = nn.LayerNorm((n_heads, self.d))
        self.k_norm = nn.LayerNorm((n_heads, self.d))
        _grown(self, 12)

    def forward(self, x):
        b, n, _ = x.shape
        keys, values = (self.wv, self.wk) if self.bug == "kv_swapped" else (self.wk, self.wv)
        q = self.wq(x).view(b, n, self.n_heads, self.d)  # [b, n, h, d]
        k = keys(x).view(b, n, self.n_heads, self.d)
        v = values(x).view(b, n, self.n_heads, self.d)
        if self.bug == "per_head":  # each head's own mean and variance, the grid's weight and bias
            q = F.layer_norm(q, (self.d,)) * self.q_norm.weight + self.q_norm.bias
            k = F.layer_norm(k, (self.d,)) * self.k_norm.weight + self.k_norm.bias
        elif self.bug != "norm_late":
            q = self.q_norm(q)
            k = k if self.bug == "no_k_norm" else self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, h, n, d]
        q, k = _half_rope(q), _half_rope(k)
        if self.bug == "norm_late":
            q = self.q_norm(q.transpose(1, 2)).transpose(1, 2)
            k = self.k_norm(k.transpose(1, 2)).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, n, -1))


class L2Norm(nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class L2NormLayer(nn.Module):
    def __init__(self, dim=32, num_heads=4, num_kv=2, rope=True, bug=None):
        super().__init__()
        self.bug, self.rope, self.nh, self.nkv, self.hd = bug, rope, num_heads, num_kv, dim // num_heads
        self.q_proj = nn.Linear(dim, num_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(dim, num_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(dim, num_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(num_heads * self.hd, dim, bias=False)
        self.qk_norm = L2Norm(1e-5)
        _grown(self, 13)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, -1, self.hd)  # [b, n, h, d]
        k = self.k_proj(x).view(b, n, -1, self.hd)
        v = self.v_proj(x).view(b, n, -1, self.hd)
        if self.rope:  # NoPE layers neither rotate nor norm
            q, k = _complex_rope(q), _complex_rope(k)
            q = self.qk_norm(q)
            k = k if self.bug == "no_k_norm" else self.qk_norm(k)
            if self.bug == "norm_v":
                v = self.qk_norm(v)
        group = self.nh // self.nkv
        if self.bug == "tiled":
            k, v = k.repeat(1, 1, group, 1), v.repeat(1, 1, group, 1)
        else:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)  # [b, h, n, n]
        if self.bug != "no_scale":
            scores = scores * self.hd ** -0.5
        causal = torch.triu(torch.full((n, n), float("-inf"), dtype=x.dtype, device=x.device), 1)
        w = F.softmax((scores + causal).float(), dim=-1).type_as(x)
        y = torch.einsum("bhqk,bkhd->bqhd", w, v)  # [b, n, h, d]
        return self.o_proj(y.reshape(b, n, -1))


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GemmaHeads(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 query_pre_attn_scalar=16, bug=None):
        super().__init__()
        self.bug, self.head_dim = bug, head_dim
        self.num_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.scaling = query_pre_attn_scalar ** -0.5
        self.q_proj = nn.Linear(hidden_size, num_attention_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_attention_heads * head_dim, hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(head_dim)
        self.k_norm = GemmaRMSNorm(head_dim)
        _grown(self, 14)

    @staticmethod
    def _whole(t, norm):
        x = t.float()  # [b, h, n, d]
        x = x * torch.rsqrt(x.pow(2).mean((1, 3), keepdim=True) + norm.eps)
        return (x * (1.0 + norm.weight.float())).type_as(t)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        shape = (b, n, -1, self.head_dim)
        k_proj, v_proj = (self.v_proj, self.k_proj) if self.bug == "kv_swapped" else (self.k_proj, self.v_proj)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [b, h, n, d]
        k = k_proj(hidden_states).view(shape).transpose(1, 2)
        v = v_proj(hidden_states).view(shape).transpose(1, 2)
        if self.bug == "whole":  # the mean taken over every head's coordinates of a token, not each head's
            q, k = self._whole(q, self.q_norm), self._whole(k, self.k_norm)
        elif self.bug != "norm_late":
            q = self.q_norm(q)
            k = k if self.bug == "no_k_norm" else self.k_norm(k)
        if self.bug == "norm_v":
            v = self.k_norm(v)
        q, k = _half_rope(q), _half_rope(k)
        if self.bug == "norm_late":
            q, k = self.q_norm(q), self.k_norm(k)
        scale = self.head_dim ** -0.5 if self.bug == "scale_dhead" else self.scaling
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, n, -1))


class JointNorms(nn.Module):
    def __init__(self, dim=32, heads=4, context_dim=24, bug=None):
        super().__init__()
        self.bug, self.heads = bug, heads
        d = dim // heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(context_dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.norm_added_q, self.norm_added_k = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.to_out = nn.Linear(dim, dim)
        self.to_add_out = nn.Linear(dim, context_dim)
        _grown(self, 15)

    def _heads(self, t):
        b = t.shape[0]
        return t.view(b, -1, self.heads, t.shape[-1] // self.heads).transpose(1, 2)  # [b, h, n, d]

    def forward(self, hidden_states, encoder_hidden_states):
        n_img = hidden_states.shape[1]
        swap = self.bug == "kv_swapped"
        q = self._heads(self.to_q(hidden_states))
        k = self._heads((self.to_v if swap else self.to_k)(hidden_states))
        v = self._heads((self.to_k if swap else self.to_v)(hidden_states))
        cq = self._heads(self.add_q_proj(encoder_hidden_states))
        ck = self._heads((self.add_v_proj if swap else self.add_k_proj)(encoder_hidden_states))
        cv = self._heads((self.add_k_proj if swap else self.add_v_proj)(encoder_hidden_states))
        q, cq = self.norm_q(q), self.norm_added_q(cq)
        if self.bug != "no_k_norm":
            k, ck = self.norm_k(k), self.norm_added_k(ck)
        if self.bug == "norm_v":
            v, cv = self.norm_k(v), self.norm_added_k(cv)
        q, k, v = torch.cat([q, cq], dim=2), torch.cat([k, ck], dim=2), torch.cat([v, cv], dim=2)
        y = F.scaled_dot_product_attention(q, k, v)  # [b, h, n_img + n_ctx, d]
        y = y.transpose(1, 2).flatten(2)
        img, ctx = y[:, :n_img], y[:, n_img:]
        return self.to_out(img), self.to_add_out(ctx)


class CachedHeads(nn.Module):
    def __init__(self, dim=32, h=4, bug=None):
        super().__init__()
        self.bug, self.h = bug, h
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.qn = nn.RMSNorm(dim // h, eps=1e-6)
        self.kn = nn.RMSNorm(dim // h, eps=1e-6)
        _grown(self, 16)

    def forward(self, x, past_kv=None):
        b, n, c = x.shape
        q = self.q(x).view(b, n, self.h, c // self.h).transpose(1, 2)  # [b, h, n, d]
        k, v = self.kv(x).view(b, n, 2, self.h, c // self.h).permute(2, 0, 3, 1, 4)  # 2 x [b, h, n, d]
        if self.bug == "kv_swapped":
            k, v = v, k
        q = self.qn(q)
        k = k if self.bug == "no_k_norm" else self.kn(k)
        if self.bug == "norm_v":
            v = self.kn(v)
        start = 0 if past_kv is None else past_kv[0].shape[2]
        q, k = _half_rope(q, start), _half_rope(k, start)
        if past_kv is not None:
            k, v = torch.cat([past_kv[0], k], dim=2), torch.cat([past_kv[1], v], dim=2)
        mask = torch.ones(n, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - n)  # bottom-right
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(b, n, c)), (k, v)
