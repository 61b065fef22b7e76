"""Styles for tests/test_trace_r12_norms.py: q/k norms without weights (Llama 4's L2Norm module after RoPE, nanochat's
F.rms_norm after RoPE, a cosine attention's F.normalize, an RMS over the whole projection written by hand), Llama 4's
NoPE temperature tuning, and a bidirectional local window passed as a mask parameter of its own (ModernBERT's
sliding_window_mask). Each correct form is checked in the tests against transformers' eager modules, SDPA or a
float64 formula; `bug=` plants one mistake."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return module


class UnitRms(nn.Module):  # Llama4TextL2Norm's form: no parameters, an eps of its own
    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class L2NormLlama(nn.Module):
    """transformers' Llama4TextAttention on a RoPE layer: complex freqs_cis (interleaved pairs), the weightless norm
    on q and k after RoPE, repeat_kv, an additive causal mask made here."""

    def __init__(self, d=32, n_head=4, n_kv=2, base=500000.0, bug=None):
        super().__init__()
        self.h, self.kv, self.dh, self.bug = n_head, n_kv, d // n_head, bug
        self.q_proj = nn.Linear(d, n_head * self.dh, bias=False)
        self.k_proj = nn.Linear(d, n_kv * self.dh, bias=False)
        self.v_proj = nn.Linear(d, n_kv * self.dh, bias=False)
        self.o_proj = nn.Linear(n_head * self.dh, d, bias=False)
        self.qk_norm = UnitRms(1e-5)
        self.rope_theta = base
        _trained(self, 11)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.dh, 2).float() / self.dh))
        freqs = torch.outer(torch.arange(n).float(), inv)
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)[None, :, None, :]
        q = self.q_proj(hidden_states).view(b, n, -1, self.dh)
        k = self.k_proj(hidden_states).view(b, n, -1, self.dh)
        v = self.v_proj(hidden_states).view(b, n, -1, self.dh).transpose(1, 2)
        q_ = torch.view_as_complex(q.float().reshape(b, n, -1, self.dh // 2, 2))
        k_ = torch.view_as_complex(k.float().reshape(b, n, -1, self.dh // 2, 2))
        q, k = torch.view_as_real(q_ * freqs_cis).flatten(3), torch.view_as_real(k_ * freqs_cis).flatten(3)
        q, k = self.qk_norm(q).transpose(1, 2), self.qk_norm(k).transpose(1, 2)
        rep = self.h // self.kv
        if self.bug == "gqa_tiled":
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k = k[:, :, None].expand(b, self.kv, rep, n, self.dh).reshape(b, self.h, n, self.dh)
            v = v[:, :, None].expand(b, self.kv, rep, n, self.dh).reshape(b, self.h, n, self.dh)
        mask = torch.full((n, n), torch.finfo(q.dtype).min).triu(1)
        w = torch.matmul(q, k.transpose(2, 3)) * self.dh ** -0.5 + mask
        w = F.softmax(w, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out)


def _rotate(x, cos, sin):  # [b, n, h, d]: the pair (i, i + d/2) turned by +θ
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class RmsNormChat(nn.Module):
    """nanochat's CausalSelfAttention with the usual RoPE direction: c_q, c_k, c_v, F.rms_norm(q, (q.size(-1),)) after
    RoPE, [b, n, h, d] until the transpose, SDPA with is_causal and enable_gqa."""

    def __init__(self, n_embd=32, n_head=4, n_kv_head=2, bug=None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.bug = n_head, n_kv_head, n_embd // n_head, bug
        self.c_q = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        _trained(self, 12)

    def forward(self, x):
        B, T, C = x.size()
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(T).float(), inv)
        cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.bug == "scale_twice":
            q = q * self.head_dim ** -0.5
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class CosineAttn(nn.Module):
    """Cosine attention: q and k rows made unit length with F.normalize, fused qkv, einsum scores over 1/√d_head,
    bidirectional."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_qkv = nn.Linear(dim, dim * 3, bias=True)
        self.to_out = nn.Linear(dim, dim)
        _trained(self, 13)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * (d // self.heads) ** -0.5
        attn = dots.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class ProjRms(nn.Module):
    """An RMS over the whole projection written by hand (OLMo 2's placement, no weights), before the heads split;
    the scores by bmm over heads folded into the batch, causal."""

    def __init__(self, d_model=32, n_heads=4, bug=None):
        super().__init__()
        self.n_heads, self.bug = n_heads, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        _trained(self, 14)

    def forward(self, x):
        b, n, d = x.shape
        h, dh = self.n_heads, d // self.n_heads
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = (t.view(b, n, h, dh).transpose(1, 2).reshape(b * h, n, dh) for t in (q, k, v))
        scale = d ** -0.5 if self.bug == "scale_d_model" else dh ** -0.5
        s = torch.bmm(q, k.transpose(1, 2)) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.bmm(s.softmax(-1), v).view(b, h, n, dh).transpose(1, 2).reshape(b, n, d)
        return self.wo(out)


def llama4_config(**over):
    """The few fields of Llama4TextConfig a NoPE layer reads."""
    fields = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1)
    fields.update(over)
    return SimpleNamespace(**fields)


def _tuned(positions, floor_scale, attn_scale):
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class NopeTuned(nn.Module):
    """Llama 4's NoPE layer: no RoPE, no qk-norm, each query scaled by log1p(floor((p + 1) / floor_scale)) ·
    attn_scale + 1 read from its config; repeat_kv, additive causal mask."""

    def __init__(self, config=None, use_rope=False, bug=None):
        super().__init__()
        self.config = config = config or llama4_config()
        self.use_rope = use_rope  # a Llama 4 RoPE layer declares the temperature too, and does not tune
        self.floor_scale, self.attn_scale = config.floor_scale, config.attn_scale
        self.attn_temperature_tuning = config.attn_temperature_tuning
        self.h, self.kv, self.dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.bug = bug
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.h * self.dh, bias=False)
        self.k_proj = nn.Linear(d, self.kv * self.dh, bias=False)
        self.v_proj = nn.Linear(d, self.kv * self.dh, bias=False)
        self.o_proj = nn.Linear(self.h * self.dh, d, bias=False)
        _trained(self, 15)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, -1, self.dh)
        k = self.k_proj(hidden_states).view(b, n, -1, self.dh).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, -1, self.dh).transpose(1, 2)
        if self.attn_temperature_tuning and not self.use_rope:
            positions = torch.arange(n)
            attn_scales = _tuned(positions, self.floor_scale, self.attn_scale).view(1, n, 1, 1)
            q = q * attn_scales
        q = q.transpose(1, 2)
        rep = self.h // self.kv
        if self.bug == "gqa_tiled":
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        w = q @ k.transpose(-1, -2) / math.sqrt(self.dh)
        w = w + torch.full((n, n), float("-inf")).triu(1)
        return self.o_proj((w.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


class TunedSdpa(nn.Module):
    """The temperature as a module attribute pair (floor_scale, attn_scale) written out with torch.log, fused qkv,
    SDPA causal; no config object."""

    def __init__(self, dim=32, heads=4, floor_scale=2, attn_scale=0.5, bug=None):
        super().__init__()
        self.heads, self.floor_scale, self.attn_scale, self.bug = heads, floor_scale, attn_scale, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        _trained(self, 16)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).unbind(2)
        pos = torch.arange(n, dtype=torch.float32)
        scales = torch.log(torch.floor((pos + 1) / self.floor_scale) + 1) * self.attn_scale + 1
        q = q * scales[None, :, None, None]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.bug == "kv_swapped":
            k, v = v, k
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class OwnRotary(nn.Module):
    """ModernBERT's rotary embedding: only an inv_freq buffer says its base (no rope_theta anywhere)."""

    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, n):
        freqs = torch.outer(torch.arange(n).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class WindowMaskBert(nn.Module):
    """ModernBERT's attention: fused Wqkv viewed [b, n, 3, h, d], transpose(3, 1).unbind(2), RoPE from its own
    inv_freq (base 80000), and a local layer that adds sliding_window_mask where a global one adds attention_mask."""

    def __init__(self, hidden=32, heads=4, local=True, bug=None):
        super().__init__()
        self.heads, self.head_dim, self.local, self.bug = heads, hidden // heads, local, bug
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.Wo = nn.Linear(hidden, hidden, bias=False)
        self.rotary_emb = OwnRotary(self.head_dim, 80000.0)
        _trained(self, 17)

    def forward(self, hidden_states, attention_mask=None, sliding_window_mask=None):
        bs, n, dim = hidden_states.shape
        qkv = self.Wqkv(hidden_states).view(bs, -1, 3, self.heads, self.head_dim)
        if self.bug == "split_without_permute":
            query, key, value = (t.reshape(bs, self.heads, n, self.head_dim) for t in qkv.unbind(dim=2))
        else:
            query, key, value = qkv.transpose(3, 1).unbind(dim=2)
        cos, sin = self.rotary_emb(n)
        query, key = query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
        scores = torch.matmul(query, key.transpose(2, 3)) * self.head_dim ** -0.5
        if self.local:
            attention_mask = sliding_window_mask
        if attention_mask is not None and self.bug != "mask_after_softmax":
            scores = scores + attention_mask
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        if attention_mask is not None and self.bug == "mask_after_softmax":
            weights = weights + attention_mask
        out = torch.matmul(weights, value).transpose(1, 2).contiguous().view(bs, -1, dim)
        return self.Wo(out)


class LocalBoolMask(nn.Module):
    """A local attention taking a boolean window_mask (True = may attend) beside a padding mask, separate q/k/v
    projections, einsum, masked_fill(~window_mask, -inf)."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        _trained(self, 18)

    def forward(self, x, mask=None, window_mask=None):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1) for f in (self.to_q, self.to_k, self.to_v))
        dots = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d // self.heads)
        if window_mask is not None and self.bug != "mask_after_softmax":
            dots = dots.masked_fill(~window_mask, float("-inf"))
        attn = dots.softmax(-1)
        if window_mask is not None and self.bug == "mask_after_softmax":
            attn = attn.masked_fill(~window_mask, 0.0)
        out = torch.einsum("bhij,bjhd->bihd", attn, v)
        return self.to_out(out.reshape(b, n, d))


class LocalSdpa(nn.Module):
    """A local attention through SDPA whose forward takes attention_mask and local_attention_mask, reading the
    local one (the plant reads attention_mask: the window left out)."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        _trained(self, 19)

    def forward(self, x, attention_mask=None, local_attention_mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = attention_mask if self.bug == "global_mask" else local_attention_mask
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class WindowFromPadding(nn.Module):
    """ModernBertModel._update_attention_mask inside the layer: the 2-D 0/1 padding made additive, and the local
    window |i - j| <= w // 2 built on it (`distance <= w // 2`; the plant writes `<`)."""

    def __init__(self, hidden=32, heads=4, local_attention=4, bug=None):
        super().__init__()
        self.attn = WindowMaskBert(hidden, heads, local=True)
        self.local_attention, self.bug = local_attention, bug

    def forward(self, hidden_states, attention_mask=None):
        bs, n, _ = hidden_states.shape
        if attention_mask is None:
            attention_mask = torch.ones(bs, n)
        padding = (1.0 - attention_mask[:, None, None, :].float()).expand(bs, 1, n, n)
        padding = padding.masked_fill(padding.bool(), torch.finfo(torch.float32).min)
        rows = torch.arange(n)[None]
        distance = (rows - rows.T).abs()
        reach = {"window_off_by_one": -1, "window_two_wider": 2}.get(self.bug, 0)  # the plants: `<` for `<=`, w + 2
        near = distance <= self.local_attention // 2 + reach
        window = padding.masked_fill(~near[None, None], torch.finfo(torch.float32).min)
        return self.attn(hidden_states, attention_mask=padding, sliding_window_mask=window)


class TunedDictConfig(nn.Module):
    """The temperature's numbers in a dict config (`cfg["floor_scale"]`), the scale applied to [b, h, n, d] queries
    after the transpose, einsum scores, bidirectional."""

    def __init__(self, cfg=None, bug=None):
        super().__init__()
        self.cfg = cfg or {"dim": 32, "heads": 4, "floor_scale": 3, "attn_scale": 0.2}
        dim, self.bug = self.cfg["dim"], bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        _trained(self, 20)

    def forward(self, x):
        b, n, d = x.shape
        h = self.cfg["heads"]
        q, k, v = (w(x).view(b, n, h, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        tau = torch.log1p(torch.floor((torch.arange(n) + 1.0) / self.cfg["floor_scale"])) * self.cfg["attn_scale"] + 1
        q = q * tau[:, None]
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d // h)
        a = s.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        return self.wo(torch.einsum("bhqk,bhkd->bhqd", a, v).transpose(1, 2).reshape(b, n, d))
