"""Attention with RoPE whose angles are no one position times a frequency (2-D / axial RoPE, prefix tokens left
unrotated, positions of another scale) and with a RoPE scaling, in the forms real libraries write them, for
tests/test_trace_round14_rope2d.py. Each takes `bug=` for a planted mistake.

- EvaRope: EVA-02's `VisionRotaryEmbeddingFast` written out: one cos/sin buffer over the patch grid, the row's
  frequencies on the first half of each head and the column's on the second, pairs interleaved (rotate_every_two);
  the cls token sliced off, the patches rotated, the two joined back; a fused qkv with q and v biases; eager softmax.
- DinoRope: DINOv3's RopePositionEmbedding: patch centres normalised to [-1, 1], angles 2π · coord / period, the
  row's and the column's angles side by side and tiled for rotate_half (half-split); a cls token and two registers in
  front, left unrotated; separate q, k, v projections and F.scaled_dot_product_attention.
- QwenVisionRope: Qwen2-VL's vision rotary: (h, w) position ids per patch, a 1-D frequency table indexed by each and
  flattened ([n, d/2]), `cat((freqs, freqs))` and rotate_half; every token rotated; a fused qkv, q·kᵀ in matmul.
- LinearLlama: transformers' LlamaLinearScalingRotaryEmbedding form: `t = arange(n) / factor`, its config's
  `rope_scaling = {"type": "linear", "factor": f}`, rotate_half.
- NeoxLinear: GPT-NeoX-like: the angle table `einsum("i,j->ij", t, inv_freq)` with `inv_freq / factor`, a fused
  query_key_value read per head.
- MetaLinear: Meta's `precompute_freqs_cis(dim, end, theta)` with positions `arange(end) / scale`, view_as_complex
  (interleaved pairs).
- Llama3Scaled: Llama 3.1's `apply_scaling` of the frequencies (low frequencies divided by the factor, a smooth ramp
  between), its config's `rope_scaling = {"rope_type": "llama3", ...}`, rotate_half.
- YarnScaled: YaRN as DeepSeek's code writes it (frequencies blended over a correction range, cos and sin times
  0.1 · ln(factor) + 1), its config's `rope_scaling = {"rope_type": "yarn", ...}`.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def _trained(module, seed=0):
    """Weights moved off their init, as a checkpoint's are."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def rotate_every_two(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# --- 2-D RoPE ---------------------------------------------------------------------------------------------------


class EvaRope(nn.Module):
    """cls + a grid x grid patch grid, EVA-02's rotary over the patches."""

    def __init__(self, dim=32, num_heads=2, grid=3, theta=10000.0, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        head_dim = dim // num_heads
        self.scale = (dim if bug == "scale_dmodel" else head_dim) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)
        half = head_dim // 2  # each axis turns half of the head
        freqs = 1.0 / theta ** (torch.arange(0, half, 2).float() / half)  # [half / 2]
        t = torch.arange(grid).float()
        f = torch.einsum("i,j->ij", t, freqs).repeat_interleave(2, dim=-1)  # [grid, half]
        rows = f[:, None, :].expand(grid, grid, half)
        cols = f[None, :, :].expand(grid, grid, half)
        table = torch.cat((rows, cols), dim=-1).reshape(grid * grid, head_dim)
        if bug == "k_grid_transposed":  # the keys' table built with rows and columns swapped
            self.register_buffer("k_cos", torch.cat((cols, rows), dim=-1).reshape(grid * grid, head_dim).cos())
            self.register_buffer("k_sin", torch.cat((cols, rows), dim=-1).reshape(grid * grid, head_dim).sin())
        self.register_buffer("freqs_cos", table.cos())
        self.register_buffer("freqs_sin", table.sin())
        _trained(self)

    def rope(self, t, cos=None, sin=None):
        cos = self.freqs_cos if cos is None else cos
        sin = self.freqs_sin if sin is None else sin
        return t * cos + rotate_every_two(t) * sin

    def forward(self, x):
        B, N, C = x.shape
        bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias), self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = torch.cat((q[:, :, :1], self.rope(q[:, :, 1:])), dim=-2).type_as(v)
        if self.bug == "k_grid_transposed":
            k = torch.cat((k[:, :, :1], self.rope(k[:, :, 1:], self.k_cos, self.k_sin)), dim=-2).type_as(v)
        else:
            k = torch.cat((k[:, :, :1], self.rope(k[:, :, 1:])), dim=-2).type_as(v)
        if self.bug == "rope_on_v":
            v = torch.cat((v[:, :, :1], self.rope(v[:, :, 1:])), dim=-2)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        out = attn @ v
        out = out.reshape(B, N, -1) if self.bug == "merge_no_transpose" else out.transpose(1, 2).reshape(B, N, -1)
        return self.proj(out)


class DinoRope(nn.Module):
    """A cls token and two registers, then an h x w patch grid (row-major), DINOv3's RoPE over the patches."""

    def __init__(self, embed_dim=32, num_heads=2, h=3, w=4, base=100.0, n_prefix=3, bug=None):
        super().__init__()
        self.num_heads, self.n_prefix, self.bug = num_heads, n_prefix, bug
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        d4 = self.head_dim // 4
        periods = base ** (2 * torch.arange(d4, dtype=torch.float32) / (self.head_dim // 2))  # [d_head / 4]
        ch = (torch.arange(0.5, h, dtype=torch.float32) / h) * 2 - 1
        cw = (torch.arange(0.5, w, dtype=torch.float32) / w) * 2 - 1
        coords = torch.stack(torch.meshgrid(ch, cw, indexing="ij"), dim=-1).flatten(0, 1)  # [h·w, 2]
        angles = 2 * math.pi * coords[:, :, None] / periods[None, None, :]  # [h·w, 2, d_head / 4]
        angles = angles.flatten(1, 2).tile(2)  # [h·w, d_head]
        self.register_buffer("sin", angles.sin())
        self.register_buffer("cos", angles.cos())
        _trained(self, seed=1)

    def _heads(self, t):
        B, N, _ = t.shape
        return t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        p = self.n_prefix
        q = torch.cat((q[:, :, :p], q[:, :, p:] * self.cos + rotate_half(q[:, :, p:]) * self.sin), dim=2)
        turn_k = rotate_every_two if self.bug == "k_pairing" else rotate_half
        k = torch.cat((k[:, :, :p], k[:, :, p:] * self.cos + turn_k(k[:, :, p:]) * self.sin), dim=2)
        if self.bug == "rope_on_v":
            v = torch.cat((v[:, :, :p], v[:, :, p:] * self.cos + rotate_half(v[:, :, p:]) * self.sin), dim=2)
        scale = C ** -0.5 if self.bug == "scale_dmodel" else None
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        out = out.reshape(B, N, C) if self.bug == "merge_no_transpose" else out.transpose(1, 2).reshape(B, N, C)
        return self.out_proj(out)


class QwenVisionRope(nn.Module):
    """Patches of an h x w grid, Qwen2-VL's vision rotary (no prefix token)."""

    def __init__(self, dim=32, num_heads=2, h=3, w=3, theta=10000.0, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)
        rot = self.head_dim // 2  # VisionRotaryEmbedding(head_dim // 2)
        inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
        hpos = torch.arange(h).unsqueeze(1).expand(-1, w).flatten()
        wpos = torch.arange(w).unsqueeze(0).expand(h, -1).flatten()
        pos_ids = torch.stack([hpos, wpos], dim=-1)  # [h·w, 2]
        seq = torch.arange(max(h, w), dtype=inv_freq.dtype)
        freqs = torch.outer(seq, inv_freq)  # [max_grid, rot / 2]
        self.register_buffer("rotary_pos_emb", freqs[pos_ids].flatten(1))  # [h·w, d_head / 2]
        _trained(self, seed=2)

    def forward(self, hidden_states):
        B, N, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 1, 3, 4).unbind(0)
        emb = torch.cat((self.rotary_pos_emb, self.rotary_pos_emb), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]  # [n, 1, d_head]: q is [B, N, heads, d_head]
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        if self.bug == "rope_on_v":
            v = (v * cos) + (rotate_half(v) * sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scale = (self.num_heads * self.head_dim if self.bug == "scale_dmodel" else self.head_dim) ** -0.5
        attn = torch.matmul(q, k.transpose(2, 3)) * scale
        attn = F.softmax(attn, dim=-2 if self.bug == "softmax_axis" else -1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(B, N, -1)
        return self.proj(out)


# --- RoPE scaling -----------------------------------------------------------------------------------------------


class ScalingConfig:
    def __init__(self, hidden_size=32, num_attention_heads=2, rope_theta=10000.0, rope_scaling=None,
                 max_position_embeddings=64):
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.max_position_embeddings = max_position_embeddings


class LinearLlama(nn.Module):
    """transformers' LLaMA with LlamaLinearScalingRotaryEmbedding; causal, additive mask built inside."""

    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config or ScalingConfig(rope_scaling={"type": "linear", "factor": 2.0})
        self.bug = bug
        c = self.config
        self.num_heads, self.head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.o_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        base = 10000.0 if bug == "base_default" else c.rope_theta  # the rotary built without base=
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)),
                             persistent=False)
        self.scaling_factor = c.rope_scaling["factor"]
        _trained(self, seed=3)

    def rotary(self, n, scaled=True):
        t = torch.arange(n, dtype=self.inv_freq.dtype)
        if scaled:
            t = t / self.scaling_factor
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(q_len)
        q = (q * cos) + (rotate_half(q) * sin)
        if self.bug == "k_unscaled":  # the keys' table made without the factor
            cos, sin = self.rotary(q_len, scaled=False)
        k = (k * cos) + (rotate_half(k) * sin)
        mask = torch.full((q_len, q_len), torch.finfo(q.dtype).min, dtype=q.dtype).triu(1)
        attn = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        attn = F.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(out)


class NeoxLinear(nn.Module):
    """GPT-NeoX-like: a fused query_key_value read per head, the angle table `einsum` over inv_freq / factor."""

    def __init__(self, hidden_size=32, num_attention_heads=2, rotary_emb_base=10000, rope_scaling_factor=4.0,
                 bug=None):
        super().__init__()
        self.num_heads, self.head_size = num_attention_heads, hidden_size // num_attention_heads
        self.bug = bug
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.rope_scaling = {"type": "linear", "factor": rope_scaling_factor}
        inv_freq = 1.0 / (rotary_emb_base ** (torch.arange(0, self.head_size, 2).float() / self.head_size))
        self.register_buffer("inv_freq", inv_freq / rope_scaling_factor, persistent=False)
        _trained(self, seed=4)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, n, self.num_heads, 3 * self.head_size)
        q = qkv[..., : self.head_size].permute(0, 2, 1, 3)
        k = qkv[..., self.head_size : 2 * self.head_size].permute(0, 2, 1, 3)
        v = qkv[..., 2 * self.head_size :].permute(0, 2, 1, 3)
        t = torch.arange(n, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.bug == "rope_on_v":
            v = v * cos + rotate_half(v) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.permute(0, 2, 1, 3).reshape(b, n, -1))


def precompute_freqs_cis(dim, end, theta=10000.0, scale=1.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, dtype=torch.float32) / scale
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


class MetaLinear(nn.Module):
    """Meta's LLaMA attention, positions interpolated: precompute_freqs_cis(..., scale) and view_as_complex."""

    def __init__(self, dim=32, n_heads=2, rope_theta=10000.0, scale=8.0, bug=None):
        super().__init__()
        self.n_heads, self.head_dim, self.bug = n_heads, dim // n_heads, bug
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.freqs_cis = precompute_freqs_cis(self.head_dim, 64, rope_theta, scale)
        _trained(self, seed=5)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        freqs_cis = self.freqs_cis[:seqlen].view(1, seqlen, 1, -1)
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        xq = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xv)
        xk = torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xv)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        if self.bug == "mask_after_softmax":
            scores = F.softmax(scores.float(), dim=-1)
            scores = scores.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1), 0.0)
        else:
            scores = scores + torch.full((seqlen, seqlen), float("-inf")).triu(1)
            scores = F.softmax(scores.float(), dim=-1)
        out = torch.matmul(scores.type_as(q), v).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(out)


def apply_scaling(freqs, scale_factor, low_freq_factor, high_freq_factor, old_context_len):
    """Llama 3.1's frequency scaling (llama-models' reference code)."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return torch.tensor(new_freqs, dtype=freqs.dtype)


def _llama_projections(module, c):
    """LLaMA's four projections and head sizes, as transformers' LlamaAttention makes them from its config."""
    module.num_heads, module.head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(module, name, nn.Linear(c.hidden_size, c.hidden_size, bias=False))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


class Llama3Scaled(nn.Module):
    """Llama 3.1's scaled RoPE, as its config declares it, rotate_half; causal SDPA."""

    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config or ScalingConfig(rope_theta=10000.0, rope_scaling=dict(LLAMA3),
                                              max_position_embeddings=512)
        c, self.bug = self.config, bug
        _llama_projections(self, c)
        base = 500000.0 if bug == "base_wrong" else c.rope_theta
        freqs = 1.0 / (base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        s = c.rope_scaling
        self.register_buffer("inv_freq", apply_scaling(freqs, s["factor"], s["low_freq_factor"],
                                                       s["high_freq_factor"], s["original_max_position_embeddings"]),
                             persistent=False)
        _trained(self, seed=6)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


def yarn_inv_freq(dim, base, factor, original_max, beta_fast=32, beta_slow=1):
    """YaRN's frequencies and attention factor, as DeepSeek's and transformers' code computes them."""
    def correction_dim(rotations):
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001), 0, 1)
    extrapolation = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = extrapolation / factor * ramp + extrapolation * (1 - ramp)
    return inv_freq, 0.1 * math.log(factor) + 1.0


class YarnScaled(nn.Module):
    """A long-context LLaMA with YaRN as its config declares it: blended frequencies, cos and sin times the
    attention factor (mscale), rotate_half; causal eager attention."""

    def __init__(self, config=None, bug=None):
        super().__init__()
        self.config = config or ScalingConfig(rope_scaling=dict(YARN), max_position_embeddings=16384)
        c, self.bug = self.config, bug
        _llama_projections(self, c)
        s = c.rope_scaling
        inv_freq, self.mscale = yarn_inv_freq(self.head_dim, c.rope_theta, s["factor"],
                                              s["original_max_position_embeddings"])
        if bug == "no_mscale":  # the attention factor left off the tables
            self.mscale = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        _trained(self, seed=7)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        emb = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq).repeat(1, 2)
        cos, sin = emb.cos() * self.mscale, emb.sin() * self.mscale
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        attn = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn = attn.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.o_proj(torch.matmul(attn, v).transpose(1, 2).reshape(b, n, -1))
