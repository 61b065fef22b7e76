"""Round 25 styles (ours): RoPE's tables as an optional parameter the code runs without, and an output projection
that writes another width than the projections read.

- SharedBlockAttention: a hybrid model's shared transformer block (HF Zamba's, Zamba2's): q, k, v read
  cat(hidden, embeddings), 2·d_model wide, o_proj writes d_model back; forward(..., position_embeddings=None) read
  only where its config asks for RoPE (`use_mem_rope`), scale (head_dim / 2) ** -0.5.
- NoPEGatedLayer: a Llama 4 / SmolLM3-like layer whose NoPE layers skip RoPE (`if self.use_rope:`), taking
  `cos=None, sin=None` it never reads there; fused qkv.
- OptionalFreqsAttention: gpt-fast-like `forward(x, mask=None, freqs_cis=None)` rotating only where it is given
  (`if freqs_cis is not None`), its out projection a diffusers-like `out_dim` (to_out writes another width than
  to_q reads).
- EinsumOutDim: weights as nn.Parameters, einsum heads, W_o [inner, d_out] with d_out ≠ d_in.

Low-rank adapters added to the projections (usertrace/adapters.py):
- SharedBlockAttention(adapters=True): Zamba2-1.2B's per-layer `nn.Sequential(Linear(d, r), Linear(r, d))` in a
  ModuleList, `q_proj(x) + adapter[i](x)` on q, k and v.
- PeftLoraAttention: peft's LoRA Linear wrapper on q and v (`base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`).
- AdapterFirstAttention: biased down/up adapters written first, `k = k_up(k_down(x)) + wk(x)`, on the keys alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def moved(module: nn.Module, seed: int) -> nn.Module:
    """Weights moved off their initial values, as trained weights are."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return module


class BlockConfig:
    def __init__(self, hidden_size=16, num_attention_heads=2, use_mem_rope=False):
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.attention_hidden_size = 2 * hidden_size
        self.attention_head_dim = 2 * hidden_size // num_attention_heads
        self.use_mem_rope = use_mem_rope


class SharedBlockAttention(nn.Module):
    def __init__(self, config=None, adapters=False, layer=1, bug=None):
        super().__init__()
        self.config = config = config or BlockConfig()
        self.layer = layer
        self.bug = bug
        self.head_dim = config.attention_head_dim
        self.scaling = 1.0 if bug == "no_scale" else (self.head_dim / 2) ** -0.5
        width = config.num_attention_heads * self.head_dim
        self.q_proj = nn.Linear(config.attention_hidden_size, width, bias=False)
        self.k_proj = nn.Linear(config.attention_hidden_size, width, bias=False)
        self.v_proj = nn.Linear(config.attention_hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.adapters = None
        if adapters:
            d, r = config.attention_hidden_size, 4
            self.adapters = nn.ModuleList(nn.ModuleList(nn.Sequential(nn.Linear(d, r, bias=False),
                                                                      nn.Linear(r, d, bias=False))
                                                        for _ in range(3)) for _ in range(2))
        moved(self, 1)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)  # [b, n, 2d]
        if self.adapters is not None:
            q_ad, k_ad, v_ad = self.adapters[self.layer]
            q, k, v = q + q_ad(hidden_states), k + k_ad(hidden_states), v + v_ad(hidden_states)
        q = q.view(hidden_shape).transpose(1, 2)  # [b, h, n, d]
        k = k.view(hidden_shape).transpose(1, 2)
        v = v.view(hidden_shape).transpose(1, 2)
        if self.config.use_mem_rope:
            cos, sin = position_embeddings
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling  # [b, h, n, n]
        if attention_mask is not None:
            w = w + attention_mask[:, :, :, : k.shape[-2]]
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v)  # [b, h, n, d]
        if self.bug != "merge_no_transpose":
            out = out.transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*input_shape, -1))  # [b, n, d_model]


class NoPEGatedLayer(nn.Module):
    def __init__(self, dim=24, heads=3, use_rope=False, bug=None):
        super().__init__()
        self.heads, self.use_rope, self.bug = heads, use_rope, bug
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        moved(self, 2)

    def forward(self, x, cos=None, sin=None, attn_mask=None):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # [b, h, n, d]
        if self.use_rope:
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [b, h, n, n]
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        attn = scores.softmax(dim=-2 if self.bug == "softmax_axis" else -1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))  # [b, n, d]


class OptionalFreqsAttention(nn.Module):
    def __init__(self, query_dim=12, heads=2, dim_head=8, out_dim=20, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        inner = heads * dim_head
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(query_dim, inner, bias=False)
        self.to_v = nn.Linear(query_dim, inner, bias=False)
        self.to_out = nn.Linear(inner, out_dim)
        moved(self, 3)

    def forward(self, x, mask=None, freqs_cis=None):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1) for f in (self.to_q, self.to_k, self.to_v))  # [b, n, h, d]
        if freqs_cis is not None:
            qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2)) * freqs_cis[:, None]
            kc = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2)) * freqs_cis[:, None]
            q, k = torch.view_as_real(qc).flatten(3), torch.view_as_real(kc).flatten(3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, n, d]
        if self.bug == "values_from_keys":
            v = k
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [b, h, n, d]
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))  # [b, n, out_dim]


class EinsumOutDim(nn.Module):
    def __init__(self, d_in=16, heads=2, d_head=6, d_out=10, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        g = torch.Generator().manual_seed(4)
        self.w_q = nn.Parameter(torch.randn(d_in, heads * d_head, generator=g) / d_in ** 0.5)
        self.w_k = nn.Parameter(torch.randn(d_in, heads * d_head, generator=g) / d_in ** 0.5)
        self.w_v = nn.Parameter(torch.randn(d_in, heads * d_head, generator=g) / d_in ** 0.5)
        self.w_o = nn.Parameter(torch.randn(heads * d_head, d_out, generator=g) / (heads * d_head) ** 0.5)

    def forward(self, x, rotary_emb=None):
        b, n, _ = x.shape
        q, k, v = (torch.einsum("bnd,de->bne", x, w).view(b, n, self.heads, -1) for w in (self.w_q, self.w_k,
                                                                                           self.w_v))
        scale = 1.0 / q.shape[-1] if self.bug == "scale_d_head" else q.shape[-1] ** -0.5
        scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale  # [b, h, n, n]
        attn = scores.softmax(-1)
        out = torch.einsum("bhij,bjhd->bihd", attn, v).reshape(b, n, -1)  # [b, n, h·d]
        return out @ self.w_o  # [b, n, d_out]


class LoraLinear(nn.Module):
    """peft's LoRA Linear: the base layer beside lora_A, lora_B, a dropout and alpha / r."""

    def __init__(self, d_in, d_out, r=2, alpha=6, bias=True):
        super().__init__()
        self.base_layer = nn.Linear(d_in, d_out, bias=bias)
        self.lora_A = nn.Linear(d_in, r, bias=False)
        self.lora_B = nn.Linear(r, d_out, bias=False)
        self.lora_dropout = nn.Dropout(0.1)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class PeftLoraAttention(nn.Module):
    def __init__(self, dim=16, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q_proj = LoraLinear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = LoraLinear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        moved(self, 5)

    def forward(self, hidden_states, attention_mask=None):
        b, n, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, n, self.heads, -1).transpose(1, 2)  # [b, h, n, d]
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scale = 1.0 if self.bug == "no_scale" else q.shape[-1] ** -0.5
        w = (q @ k.transpose(-1, -2)) * scale  # [b, h, n, n]
        if attention_mask is not None:
            w = w + attention_mask
        out = w.softmax(-1) @ v  # [b, h, n, d]
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))  # [b, n, d]


class AdapterFirstAttention(nn.Module):
    def __init__(self, dim=24, heads=3, rank=3, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.k_down = nn.Linear(dim, rank)
        self.k_up = nn.Linear(rank, dim)
        self.wo = nn.Linear(dim, dim, bias=False)
        moved(self, 6)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q = self.wq(x)
        k = self.k_up(self.k_down(x)) + self.wk(x)
        v = self.wv(x)
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))  # [b, h, n, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [b, h, n, d]
        if self.bug == "merge_no_transpose":
            return self.wo(out.reshape(b, n, d))
        return self.wo(out.permute(0, 2, 1, 3).reshape(b, n, d))  # [b, n, d]
