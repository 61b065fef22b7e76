"""Heads normed one by one (a qk-norm over d_head, on [n_batch, n, n_head, d_head]) and then split without the
transpose, `reshape(b, h, n, d)` where `transpose(1, 2)` belongs (held-out round 13b's Persimmon plant, named only
in words before). Three styles; `bug="split_no_transpose"` plants it in Q, K and V."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _cos_sin(n, dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class PersimmonLike(nn.Module):
    """Persimmon's: a fused query_key_value viewed [b, s, h, 3, d], a LayerNorm of each head, RoPE on the share of
    each head its partial_rotary_factor says, an additive mask, softmax in float32."""

    def __init__(self, hidden_size=32, num_heads=4, partial_rotary_factor=0.5, bug=None):
        super().__init__()
        self.h, self.d, self.bug = num_heads, hidden_size // num_heads, bug
        self.partial_rotary_factor = partial_rotary_factor
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.q_layernorm = nn.LayerNorm(self.d)
        self.k_layernorm = nn.LayerNorm(self.d)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        b, s, _ = hidden_states.shape
        fused = self.query_key_value(hidden_states).view(b, s, self.h, 3, self.d)
        q, k, v = fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
        q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.bug == "split_no_transpose":
            q, k, v = (t.reshape(b, self.h, s, self.d) for t in (q, k, v))
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        r = int(self.d * self.partial_rotary_factor)
        cos, sin = _cos_sin(s, r)
        q_rot, k_rot = q[..., :r], k[..., :r]
        q = torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., r:]), dim=-1)
        k = torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., r:]), dim=-1)
        w = q @ k.transpose(2, 3) / math.sqrt(self.d)
        if attention_mask is not None:
            w = w + attention_mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.dense((w @ v).transpose(1, 2).reshape(b, s, -1))


class Olmo2Like(nn.Module):
    """Qwen3's / OLMo's shape of it: separate projections, an RMSNorm of each head's d_head, RoPE on the whole head,
    SDPA with is_causal."""

    def __init__(self, hidden_size=32, num_heads=4, eps=1e-6, bug=None):
        super().__init__()
        self.h, self.d, self.eps, self.bug = num_heads, hidden_size // num_heads, eps, bug
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden_size, hidden_size, bias=False)
                                                              for _ in range(4))
        self.q_norm = nn.Parameter(torch.ones(self.d))
        self.k_norm = nn.Parameter(torch.ones(self.d))

    def _rms(self, x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        b, s, _ = x.shape
        q = self._rms(self.q_proj(x).view(b, s, self.h, self.d), self.q_norm)
        k = self._rms(self.k_proj(x).view(b, s, self.h, self.d), self.k_norm)
        v = self.v_proj(x).view(b, s, self.h, self.d)
        if self.bug == "split_no_transpose":
            q, k, v = (t.reshape(b, self.h, s, self.d) for t in (q, k, v))
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cos, sin = _cos_sin(s, self.d)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class NormedNoRope(nn.Module):
    """ViT-22B's / timm's qk_norm without RoPE: a fused qkv viewed [b, n, 3, h, d], LayerNorm of each head, eager."""

    def __init__(self, dim=32, num_heads=4, bug=None):
        super().__init__()
        self.h, self.d, self.bug = num_heads, dim // num_heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm, self.k_norm = nn.LayerNorm(self.d), nn.LayerNorm(self.d)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.d).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.bug == "split_no_transpose":
            q, k, v = (t.reshape(b, self.h, n, self.d) for t in (q, k, v))
        else:
            q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
        attn = (q * self.d ** -0.5) @ k.transpose(-2, -1)
        return self.proj((attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, c))
