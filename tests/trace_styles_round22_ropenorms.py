"""Styles of our own whose qk-norm meets a RoPE written as complex products, Gemma's (1 + w) gain, or a norm over the
whole projection, for tests/test_trace_round22_ropenorms.py. Weights moved off their initial values.

- MetaNormed: Meta llama's layer (wq, wk, wv, wo; precompute_freqs_cis; apply_rotary_emb as
  `torch.view_as_complex(x.float().reshape(..., -1, 2)) * freqs_cis`, interleaved pairs) with an RMSNorm of weights
  per head on q and k before RoPE (Qwen3's place), grouped keys by repeat_kv. `late=True` norms the rotated heads (a
  convention of its own); `bug`: 'after_rope' (the norms on the rotated heads where the code means before),
  'no_k_norm' (k never normed), 'no_norm' (neither).
- GemmaNormed: Gemma 3's eager attention (Gemma3RMSNorm: `x · (1 + weight)` in float32; rotate_half with cos/sin
  tables; q scaled by query_pre_attn_scalar^-0.5). `late=True` norms the rotated heads (a convention of its own);
  `bug`: 'after_rope' (the norms after RoPE where the code means before), 'no_k_norm'.
- OlmoWhole: OLMo 2's attention (q_norm, k_norm RMSNorms over the whole projection, before the heads are split),
  RoPE as complex products on half-split pairs (`torch.complex(x1, x2) * turn`). `late=True` norms the rotated
  projection; `bug`: 'after_rope', 'no_k_norm'.
- ComplexGemma: Llama 4-like complex RoPE (interleaved, freqs_cis as a module buffer) with Gemma's (1 + w) norm,
  written in a functional style (F.rms_norm(x, (d,)) * (1 + w)); `late`, `bug` as above.
- WideLayerNormed: a DiT-like block's attention without RoPE (one fused qkv Linear, nn.LayerNorm over the whole
  projection on q and k, a gain and a bias each, before the heads are split with einsum-free views; bidirectional).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def trained(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


# --- Meta's llama: complex products, interleaved pairs -----------------------------------------------------------

def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[None, :, None, :]  # [1, seqlen, 1, dim/2]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float()).type_as(x) * self.weight


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep,
                                                                                     head_dim)


class MetaNormed(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, late: bool = False, bug: str = "") -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.bug = n_heads, n_kv_heads, dim // n_heads, bug
        self.late = late
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)
        trained(self, 22)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        freqs_cis = precompute_freqs_cis(self.head_dim, seqlen)
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        late = self.late or self.bug == "after_rope"
        if not late and self.bug != "no_norm":
            xq = self.q_norm(xq)
            xk = xk if self.bug == "no_k_norm" else self.k_norm(xk)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        if late:
            xq = self.q_norm(xq)
            xk = xk if self.bug == "no_k_norm" else self.k_norm(xk)
        keys = repeat_kv(xk, self.n_heads // self.n_kv_heads)
        values = repeat_kv(xv, self.n_heads // self.n_kv_heads)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
        scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)  # [bsz, n_heads, seqlen, head_dim]
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


# --- Gemma 3: (1 + w) norms, rotate_half ---------------------------------------------------------------------------

class Gemma3RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def cos_sin(n: int, d: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(n).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class GemmaNormed(nn.Module):
    def __init__(self, hidden_size: int = 32, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8,
                 query_pre_attn_scalar: float = 8.0, late: bool = False, bug: str = "") -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = query_pre_attn_scalar ** -0.5
        self.late, self.bug = late, bug
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = Gemma3RMSNorm(head_dim)
        self.k_norm = Gemma3RMSNorm(head_dim)
        trained(self, 3)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
        late = self.late or self.bug == "after_rope"
        if not late:
            q, k = self.q_norm(q), (k if self.bug == "no_k_norm" else self.k_norm(k))
        cos, sin = cos_sin(n, self.head_dim)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if late:
            q, k = self.q_norm(q), (k if self.bug == "no_k_norm" else self.k_norm(k))
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        w = w.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out)


# --- OLMo 2: a norm over the whole projection, complex products on half-split pairs -----------------------------

def rope_complex_half(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """[b, h, n, d]: coordinate i with i + d/2 as one complex number, turned by its position's angle."""
    n, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    turn = torch.polar(torch.ones(n, d // 2), torch.outer(torch.arange(n, dtype=torch.float32), inv))
    z = torch.complex(x[..., : d // 2].float(), x[..., d // 2:].float()) * turn
    return torch.cat((z.real, z.imag), dim=-1).type_as(x)


class OlmoWhole(nn.Module):
    def __init__(self, d_model: int = 32, n_heads: int = 4, late: bool = False, bug: str = "") -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.late, self.bug = n_heads, d_model // n_heads, late, bug
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.q_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.k_norm = nn.RMSNorm(d_model, eps=1e-6)
        trained(self, 7)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # [b, n, d_model] -> [b, h, n, d]

    def _merged(self, t: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = t.shape
        return t.transpose(1, 2).reshape(b, n, -1)  # [b, h, n, d] -> [b, n, d_model]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        late = self.late or self.bug == "after_rope"
        if not late:
            q, k = self.q_norm(q), (k if self.bug == "no_k_norm" else self.k_norm(k))
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        q, k = rope_complex_half(q), rope_complex_half(k)
        if late:
            q = self._heads(self.q_norm(self._merged(q)))
            k = k if self.bug == "no_k_norm" else self._heads(self.k_norm(self._merged(k)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(self._merged(out))


# --- Llama 4-like complex RoPE with a (1 + w) gain, functional -----------------------------------------------------

class ComplexGemma(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, late: bool = False, bug: str = "") -> None:
        super().__init__()
        self.heads, self.d, self.late, self.bug = heads, dim // heads, late, bug
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.q_scale = nn.Parameter(torch.zeros(self.d))
        self.k_scale = nn.Parameter(torch.zeros(self.d))
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.d, 64, theta=10000.0), persistent=False)
        trained(self, 11)

    def _norm(self, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(t.float(), (self.d,), eps=1e-6).type_as(t) * (1 + scale)

    def _rope(self, t: torch.Tensor) -> torch.Tensor:  # [b, n, h, d]
        n = t.shape[1]
        z = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2)) * self.freqs_cis[:n, None, :]
        return torch.view_as_real(z).flatten(3).type_as(t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.d).unbind(2)  # each [b, n, h, d]
        late = self.late or self.bug == "after_rope"
        keep_k = self.bug == "no_k_norm"
        if not late:
            q, k = self._norm(q, self.q_scale), (k if keep_k else self._norm(k, self.k_scale))
        q, k = self._rope(q), self._rope(k)
        if late:
            q, k = self._norm(q, self.q_scale), (k if keep_k else self._norm(k, self.k_scale))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


# --- a DiT-like attention: LayerNorm over the whole projection, no RoPE --------------------------------------------

class WideLayerNormed(nn.Module):
    def __init__(self, dim: int = 24, num_heads: int = 3) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm_q = nn.LayerNorm(dim, eps=1e-5)
        self.norm_k = nn.LayerNorm(dim, eps=1e-5)
        self.out = nn.Linear(dim, dim)
        trained(self, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each [b, n, c]
        q, k = self.norm_q(q), self.norm_k(k)
        q, k, v = (t.reshape(b, n, self.num_heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))  # [b, h, n, d]
        attn = (q @ k.transpose(-2, -1)) * (c // self.num_heads) ** -0.5
        out = attn.softmax(dim=-1) @ v  # [b, h, n, d]
        return self.out(out.permute(0, 2, 1, 3).reshape(b, n, c))
