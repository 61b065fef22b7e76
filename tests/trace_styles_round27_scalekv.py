"""Attention whose own scale carries a factor, and keys and values swapped before RoPE (round 27b's HF DeBERTa-v2 and
Pixtral): a DeBERTa-like block over [B, H, n, d] that adds c2p and p2c relative terms and divides each part by
√(d_head · scale_factor), scale_factor = 1 + its two terms; a block that scales by (d_head · k)^-0.5 with its own k
(declared as Gemma 2's query_pre_attn_scalar = k · d_head, or kept as `self.k`, its scale given with --scale); a
Pixtral-like block rotating q and k by 2-D RoPE tables (cos, sin) a rotary of its own hands it for a grid of patches,
bidirectional; a LLaMA-like block with 1-D RoPE (rotate_half). Plants: every scale on d_model in d_head's place
(√(k · d_model)), k_proj and v_proj exchanged before the RoPE (the value projection's output rotated as keys)."""

import torch
import torch.nn as nn


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values (no zero bias, no weight of 1), as a trained model's are."""
    g = torch.Generator().manual_seed(2727)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g) + 0.02)
    return module


class DisentangledBlock(nn.Module):
    """DeBERTa-v2-like: c2p and p2c with shared position projections, relative positions i − j clamped to ±span,
    every part divided by √(d_head · scale_factor); no output projection."""

    def __init__(self, hidden=32, heads=4, span=4, bug=None):
        super().__init__()
        self.h, self.d, self.span, self.bug = heads, hidden // heads, span, bug
        self.query_proj, self.key_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.value_proj = nn.Linear(hidden, hidden)
        self.rel_embeddings = nn.Parameter(torch.randn(2 * span, hidden) * 0.2)
        _trained(self)

    def _heads(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.h, self.d).permute(0, 2, 1, 3)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q, k, v = (self._heads(p(hidden_states)) for p in (self.query_proj, self.key_proj, self.value_proj))
        scale_factor = 1 + 2  # c2p and p2c
        width = self.h * self.d if self.bug == "scale_hidden" else self.d
        scale = torch.sqrt(torch.tensor(width * scale_factor, dtype=q.dtype))
        scores = q @ (k.transpose(-1, -2) / scale)
        pos = torch.arange(n)
        relative = pos[:, None] - pos[None, :]  # i − j
        index = (relative + self.span).clamp(0, 2 * self.span - 1).expand(b, self.h, n, n)
        p2c_index = (-relative + self.span).clamp(0, 2 * self.span - 1).expand(b, self.h, n, n)
        rel = self.rel_embeddings[None]
        pos_k, pos_q = (self._heads(p(rel)) for p in (self.key_proj, self.query_proj))  # [1, H, 2span, d]
        c2p = torch.gather(q @ pos_k.transpose(-1, -2), -1, index)
        p2c = torch.gather(k @ pos_q.transpose(-1, -2), -1, p2c_index).transpose(-1, -2)
        scores = scores + c2p / scale + p2c / scale
        probs = torch.softmax(scores, dim=-1)
        return (probs @ v).permute(0, 2, 1, 3).reshape(b, n, self.h * self.d)


class PreAttnScalar(nn.Module):
    """A scale of its own, (k · d_head)^-0.5, declared as query_pre_attn_scalar = k · d_head (Gemma 2's name)."""

    def __init__(self, hidden=32, heads=4, k=3, bug=None):
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        self.query_pre_attn_scalar = k * self.head_dim
        wide = k * hidden if bug == "scale_hidden" else self.query_pre_attn_scalar
        self.scaling = wide ** -0.5
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.v_proj, self.o_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        _trained(self)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out)


class KScaled(nn.Module):
    """Fused qkv, scores times (d_head · self.k)^-0.5; its scale is told with --scale."""

    def __init__(self, d_model=32, n_head=2, k=2, bug=None):
        super().__init__()
        self.n_head, self.k, self.bug = n_head, k, bug
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        _trained(self)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.reshape(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        size = C if self.bug == "scale_hidden" else C // self.n_head
        att = (q @ k.transpose(-2, -1)) * (size * self.k) ** -0.5
        y = att.softmax(dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(B, T, C))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class GridRotary(nn.Module):
    """Pixtral-like axial tables for a grid of patches: a patch's row turns half the frequencies, its column the
    other half; (cos, sin) [n, d_head]."""

    def __init__(self, head_dim=8, rows=2, cols=4, theta=10000.0):
        super().__init__()
        self.rows, self.cols = rows, cols
        freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        h, w = torch.arange(rows).float(), torch.arange(cols).float()
        by_row, by_col = torch.outer(h, freqs[::2]), torch.outer(w, freqs[1::2])
        half = torch.cat([by_row[:, None, :].expand(rows, cols, -1), by_col[None, :, :].expand(rows, cols, -1)],
                         dim=-1).reshape(rows * cols, head_dim // 2)
        self.register_buffer("inv_freq", torch.cat((half, half), dim=-1), persistent=False)

    def forward(self, x):
        angles = self.inv_freq[: x.shape[1]].to(x.dtype)
        return angles.cos(), angles.sin()


class GridAttention(nn.Module):
    """Pixtral-like: bidirectional, RoPE tables handed in as position_embeddings, applied by rotate_half."""

    def __init__(self, hidden=32, heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = heads, hidden // heads, bug
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.v_proj, self.o_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states, position_embeddings):
        b, n, _ = hidden_states.shape
        key_proj, value_proj = (self.v_proj, self.k_proj) if self.bug == "kv_swapped" else (self.k_proj, self.v_proj)
        q, k, v = (p(hidden_states).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, key_proj, value_proj))
        cos, sin = position_embeddings
        cos, sin = cos[None, None], sin[None, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        weights = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scaling, dim=-1)
        return self.o_proj(torch.matmul(weights, v).transpose(1, 2).reshape(b, n, -1))


class GridBlock(nn.Module):
    """Called as Pixtral's vision model calls its attention: the rotary's tables first, then the attention."""

    def __init__(self, hidden=32, heads=4, bug=None):
        super().__init__()
        self.patch_positional_embedding = GridRotary(hidden // heads)
        self.attention = GridAttention(hidden, heads, bug)
        _trained(self)

    def forward(self, patch_embeds):
        return self.attention(patch_embeds, self.patch_positional_embedding(patch_embeds))


class LlamaLike(nn.Module):
    """LLaMA-like: 1-D RoPE (base 10000, rotate_half) on q and k, causal, its own cos/sin from positions."""

    def __init__(self, hidden=32, heads=4, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = heads, hidden // heads, bug
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.v_proj, self.o_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        _trained(self)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        key_states, value_states = self.k_proj(hidden_states), self.v_proj(hidden_states)
        if self.bug == "kv_swapped":
            key_states, value_states = value_states, key_states
        k = key_states.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        v = value_states.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        freqs = torch.outer(torch.arange(n, dtype=self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(q.dtype)
        cos, sin = emb.cos(), emb.sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        causal = torch.full((n, n), float("-inf"), dtype=q.dtype).triu(1)
        weights = torch.softmax(q @ k.transpose(2, 3) / self.head_dim ** 0.5 + causal, dim=-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, n, -1))
