"""Attention whose weights meet the values transposed, `attn.transpose(-2, -1) @ v`: each query's softmax row taken
as a column, so output row j sums the values with the weights every query gave key j. It runs only where n_Q = n_K
(self-attention). Correct blocks and the plant in four styles: heads [B, H, S, D] with @ (a BERT-like block), heads
folded into the batch with torch.bmm (fairseq's layout), taming-transformers' AttnBlock over a feature map (1x1
Conv2d projections, `torch.bmm(v, w_)` with or without `w_.permute(0, 2, 1)`), and an einsum
('bhqk,bhkd->bhqd' right, 'bhqk,bhqd->bhkd' the plant)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values (norm weights off 1, biases off 0), as a trained model's are."""
    g = torch.Generator().manual_seed(2711)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g) + 0.03)
    return module


class HeadsMatmul(nn.Module):
    """q, k, v Linear layers, heads [B, H, S, D], `attn @ v` (the plant: `attn.transpose(-2, -1) @ v`)."""

    def __init__(self, d_model=32, n_head=4, bug=None):
        super().__init__()
        self.n_head, self.d_head, self.bug = n_head, d_model // n_head, bug
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        _trained(self)

    def _heads(self, t):
        B, S, _ = t.shape
        return t.view(B, S, self.n_head, self.d_head).transpose(1, 2)

    def forward(self, x, attention_mask=None):
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        attn = scores.softmax(dim=-1)
        out = attn.transpose(-2, -1) @ v if self.bug == "pattern_t" else attn @ v
        B, H, S, D = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, S, H * D))


class FoldedBmm(nn.Module):
    """A fused in-projection, heads folded into the batch [B·H, S, D] (fairseq's), torch.bmm throughout; the plant:
    `torch.bmm(attn_weights.transpose(1, 2), v)`."""

    def __init__(self, embed_dim=24, num_heads=3, bug=None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = num_heads, embed_dim // num_heads, bug
        self.scaling = self.head_dim ** -0.5
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        _trained(self)

    def forward(self, hidden_states):
        bsz, tgt_len, embed_dim = hidden_states.shape
        q, k, v = self.in_proj(hidden_states).chunk(3, dim=-1)
        q = q * self.scaling
        q, k, v = (t.reshape(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
                   .reshape(bsz * self.num_heads, tgt_len, self.head_dim) for t in (q, k, v))
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        attn_weights = F.softmax(attn_weights, dim=-1)
        if self.bug == "pattern_t":
            attn_output = torch.bmm(attn_weights.transpose(1, 2), v)
        else:
            attn_output = torch.bmm(attn_weights, v)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(bsz, tgt_len, embed_dim))


class AttnBlock(nn.Module):
    """taming-transformers' AttnBlock (GroupNorm, 1x1 Conv2d q, k, v, proj_out, the residual): the plant leaves out
    `w_.permute(0, 2, 1)` before `torch.bmm(v, w_)`."""

    def __init__(self, in_channels=16, bug=None):
        super().__init__()
        self.bug = bug
        self.norm = nn.GroupNorm(num_groups=4, num_channels=in_channels, eps=1e-6, affine=True)
        self.q = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.k = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.v = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.proj_out = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        _trained(self)

    def forward(self, x):
        h_ = self.norm(x)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        q = q.reshape(b, c, h * w).permute(0, 2, 1)  # b,hw,c
        k = k.reshape(b, c, h * w)  # b,c,hw
        w_ = torch.bmm(q, k) * (int(c) ** (-0.5))  # b,hw,hw
        w_ = torch.nn.functional.softmax(w_, dim=2)
        v = v.reshape(b, c, h * w)
        if self.bug != "pattern_t":
            w_ = w_.permute(0, 2, 1)
        h_ = torch.bmm(v, w_).reshape(b, c, h, w)
        return x + self.proj_out(h_)


class EinsumHeads(nn.Module):
    """A fused qkv Linear, heads by einsum: 'bhqd,bhkd->bhqk' scores, 'bhqk,bhkd->bhqd' out (the plant:
    'bhqk,bhqd->bhkd', the weights summed over the queries)."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.scale = (dim // heads) ** -0.5
        self.to_qkv = nn.Linear(dim, dim * 3, bias=True)
        self.to_out = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x, causal=False):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale
        if causal:
            future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            dots = dots.masked_fill(future, -torch.finfo(dots.dtype).max)
        attn = dots.softmax(dim=-1)
        if self.bug == "pattern_t":
            out = torch.einsum("bhqk,bhqd->bhkd", attn, v)
        else:
            out = torch.einsum("bhqk,bhkd->bhqd", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))
