"""Two code styles held out of the trace work (issue 41), written by the lead: timm's Attention with
qk_norm=True (its own LayerNorms of q and k, a convention trace reads by experiment) and GPT-2's Conv1D written
out (a fused [d, 3d] nn.Parameter used as x @ W, its bias added on the next line). Planted bugs: `bug=`."""

import math

import torch
import torch.nn as nn


class TimmAttention(nn.Module):
    def __init__(self, dim=48, num_heads=4, qk_norm=True, bug=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.bug = bug

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        q = q * (self.scale if self.bug != "scale_dmodel" else C ** -0.5)
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1 if self.bug != "axis" else -2)
        x = attn @ v
        if self.bug == "merge":
            x = x.reshape(B, N, C)
        else:
            x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Conv1DAttention(nn.Module):
    """GPT-2's HF layout: c_attn.weight is [d, 3d], used as x @ W + b."""

    def __init__(self, n_embd=48, n_head=4, bug=None):
        super().__init__()
        self.n_head = n_head
        self.w_attn = nn.Parameter(torch.randn(n_embd, 3 * n_embd) * 0.1)
        self.b_attn = nn.Parameter(torch.randn(3 * n_embd) * 0.1)
        self.w_proj = nn.Parameter(torch.randn(n_embd, n_embd) * 0.1)
        self.b_proj = nn.Parameter(torch.randn(n_embd) * 0.1)
        self.bug = bug
        n = 64
        self.register_buffer("bias", torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n))

    def _split(self, t):
        B, T, C = t.shape
        return t.view(B, T, self.n_head, C // self.n_head).permute(0, 2, 1, 3)

    def forward(self, hidden_states):
        qkv = hidden_states @ self.w_attn + self.b_attn
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=2)
        q, k, v = self._split(q), self._split(k), self._split(v)
        if self.bug == "kv_swap":
            k, v = v, k
        w = q @ k.transpose(-1, -2) / math.sqrt(v.size(-1))
        T = q.size(-2)
        mask = self.bias[:, :, :T, :T]
        if self.bug == "mask_after":
            w = w.softmax(-1).masked_fill(~mask, 0.0)
        else:
            w = w.masked_fill(~mask, torch.finfo(w.dtype).min).softmax(-1)
        a = (w @ v).permute(0, 2, 1, 3).contiguous()
        a = a.view(a.size(0), a.size(1), -1)
        return a @ self.w_proj + self.b_proj
