"""A qk-norm where `--qk-norm` says it is, for docs/trace.md ("Biases, qk-norm and the scale"): OLMo 2's RMSNorms over
the whole projection before the head split (`--qk-norm proj`), rotate_half RoPE, grouped key/value heads.

`bug=` plants a mistake: "norm_after_rope" (the norms run over the rotated projection, after RoPE), "no_k_norm"
(the keys never normalized), "norm_v" (the values normalized by the keys' norm).
"""

import torch
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim=32, n_head=4, n_kv_head=2, bug=None):
        super().__init__()
        self.h, self.kv, self.d, self.bug = n_head, n_kv_head, dim // n_head, bug
        self.q_proj = nn.Linear(dim, n_head * self.d, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_head * self.d, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_head * self.d, bias=False)
        self.o_proj = nn.Linear(n_head * self.d, dim, bias=False)
        self.q_norm = nn.RMSNorm(n_head * self.d, eps=1e-6)  # over the whole projection, OLMo 2's
        self.k_norm = nn.RMSNorm(n_kv_head * self.d, eps=1e-6)
        with torch.no_grad():  # trained: gains off 1
            self.q_norm.weight.copy_(torch.linspace(0.5, 1.5, n_head * self.d))
            self.k_norm.weight.copy_(torch.linspace(1.5, 0.5, n_kv_head * self.d))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.bug != "norm_after_rope":
            q = self.q_norm(q)
            k = k if self.bug == "no_k_norm" else self.k_norm(k)
        if self.bug == "norm_v":
            v = self.k_norm(v)
        q = q.view(b, n, self.h, self.d).transpose(1, 2)  # [b, n_head, n, d]
        k = k.view(b, n, self.kv, self.d).transpose(1, 2)  # [b, n_kv_head, n, d]
        v = v.view(b, n, self.kv, self.d).transpose(1, 2)
        inv = 10000.0 ** (-torch.arange(0, self.d, 2, dtype=x.dtype) / self.d)
        angles = torch.outer(torch.arange(n, dtype=x.dtype), inv).repeat(1, 2)  # [n, d]
        q = q * angles.cos() + rotate_half(q) * angles.sin()
        k = k * angles.cos() + rotate_half(k) * angles.sin()
        if self.bug == "norm_after_rope":  # the rotated projection normed
            q = self.q_norm(q.transpose(1, 2).reshape(b, n, -1)).view(b, n, self.h, self.d).transpose(1, 2)
            k = self.k_norm(k.transpose(1, 2).reshape(b, n, -1)).view(b, n, self.kv, self.d).transpose(1, 2)
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, n_head, n, d]
        return self.o_proj(y.transpose(1, 2).reshape(b, n, -1))
