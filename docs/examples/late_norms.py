"""A norm over the whole projection after RoPE, and multi-head latent attention whose rotary parts never turn, for
docs/trace.md ("How conventions are read", "Multi-head latent attention").

- RotatedThenNormed: OLMo 2's q_norm and k_norm (RMSNorm over every head's coordinates at once) moved past the
  rotation: the projections split, turned half-split as complex numbers, merged, normed, split again.
- LatentNoRope: DeepSeek's inference form of MLA with `bug="no_rope"`: the rotary parts of q and k never turned.
"""

import torch
import torch.nn.functional as F
from torch import nn


def trained(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


class RotatedThenNormed(nn.Module):
    def __init__(self, d_model=32, n_heads=4):
        super().__init__()
        self.h, self.d = n_heads, d_model // n_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model, bias=False)
                                                              for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(d_model, eps=1e-6), nn.RMSNorm(d_model, eps=1e-6)
        trained(self, 1)

    def rotate(self, x):  # [b, h, n, d]: coordinate i with i + d/2 as one complex number
        n = x.shape[-2]
        inv = 10000.0 ** (-torch.arange(0, self.d, 2).float() / self.d)
        z = torch.complex(x[..., : self.d // 2], x[..., self.d // 2:]) * torch.polar(
            torch.ones(n, self.d // 2), torch.outer(torch.arange(n).float(), inv))
        return torch.cat((z.real, z.imag), dim=-1)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.h, self.d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotate(q), self.rotate(k)
        q = self.q_norm(q.transpose(1, 2).reshape(b, n, -1)).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_norm(k.transpose(1, 2).reshape(b, n, -1)).view(b, n, self.h, self.d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class LatentNoRope(nn.Module):
    def __init__(self, dim=32, n_heads=4, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                 bug=None):
        super().__init__()
        self.n_heads, self.rank, self.bug = n_heads, kv_lora_rank, bug
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.wq = nn.Linear(dim, n_heads * (qk_nope_head_dim + qk_rope_head_dim), bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=1e-6)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        trained(self, 2)

    def forward(self, x, start_pos=0):
        b, n, _ = x.shape
        freqs = torch.outer(torch.arange(start_pos, start_pos + n).float(),
                            10000.0 ** (-torch.arange(0, self.rope, 2).float() / self.rope))
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)[None, :, None]  # [1, n, 1, d_rope / 2]
        q = self.wq(x).view(b, n, self.n_heads, -1)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        k_pe = k_pe.unsqueeze(2)
        if self.bug != "no_rope":  # the checkpoint's interleaved pairs, turned as complex numbers
            q_pe, k_pe = (torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2)) * freqs_cis)
                          .flatten(3) for t in (q_pe, k_pe))
        kv = self.wkv_b(self.kv_norm(kv)).view(b, n, self.n_heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        scores = torch.einsum("bshd,bthd->bsht", q, k) * q.shape[-1] ** -0.5
        scores = scores + torch.full((n, n), float("-inf")).triu(1).unsqueeze(1)
        out = torch.einsum("bsht,bthd->bshd", scores.softmax(dim=-1), v)
        return self.wo(out.flatten(2))
