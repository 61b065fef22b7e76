"""Attention modules for tests/test_trace_f12_kv.py.

Fused projections whose bias says which block is the keys' (a constant-zero block beside learned ones), in the
forms BEiT / Swin v2 (`cat(q_bias, zeros_like(v_bias), v_bias)`), EVA (a zero buffer `k_bias`), a chunked
`qkv_bias` parameter with its k part replaced by `new_zeros`, and a fused K/V projection beside a Q one: each with
the plant `kv_renamed`, the unpacking of the fused output naming k and v the other way round; and Whisper's
biases (none on the keys' Linear) on three Linear layers whose names say no role, with the same plant.

Modules whose attention output gets a term of their own beside `attn @ v`: Shaw et al.'s relative position
values (`attn @ rel_v` per query row, an einsum), a learned output bias per query position, and a gated
per-head value term; each with planted mistakes elsewhere (scale, softmax axis, mask).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _moved(*params: torch.Tensor, seed: int = 3) -> None:
    """Parameters off their init, as a trained model's are (a zero bias would hide which block is which)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class CatZerosBias(nn.Module):
    """BEiT / Swin v2: no bias in the Linear, q_bias and v_bias parameters, the keys' part zeros_like."""

    def __init__(self, dim: int = 32, num_heads: int = 4, bug: str | None = None, key_bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.k_bias = nn.Parameter(torch.zeros(dim)) if key_bias else None  # a learned one: blocks alike
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)
        _moved(*(p for p in (self.q_bias, self.k_bias, self.v_bias) if p is not None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        k_bias = self.k_bias if self.k_bias is not None else torch.zeros_like(self.v_bias, requires_grad=False)
        qkv_bias = torch.cat((self.q_bias, k_bias, self.v_bias))
        qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        if self.bug == "kv_renamed":
            q, v, k = qkv.unbind(0)
        else:
            q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class ZeroBufferBias(nn.Module):
    """EVA: the keys' bias a zero buffer, the three concatenated; a packed axis of 3 unbound."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.out = nn.Linear(dim, dim)
        _moved(self.q_bias, self.v_bias, seed=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        qkv = qkv.view(b, n, 3, self.heads, d // self.heads).transpose(1, 3)  # [b, h, 3, n, d_head]
        if self.bug == "kv_renamed":
            q, v, k = qkv.unbind(2)
        else:
            q, k, v = qkv.unbind(2)
        w = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads), dim=-1)
        return self.out(torch.matmul(w, v).transpose(1, 2).reshape(b, n, d))


class ChunkedParamBias(nn.Module):
    """One weight `[d, 3d]` used as `x @ W + b`, its bias a learned `[3d]` whose k chunk the code replaces with
    `new_zeros`; heads by einsum."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.bug = n_heads, bug
        self.w_qkv = nn.Parameter(torch.randn(d_model, 3 * d_model) / math.sqrt(d_model))
        self.b_qkv = nn.Parameter(torch.zeros(3 * d_model))
        self.w_out = nn.Linear(d_model, d_model)
        _moved(self.b_qkv, seed=5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_batch, n, d = x.shape
        b_q, b_k, b_v = self.b_qkv.chunk(3)
        y = x @ self.w_qkv + torch.cat([b_q, b_k.new_zeros(b_k.shape), b_v])
        if self.bug == "kv_renamed":
            q, v, k = y.split(d, dim=-1)
        else:
            q, k, v = y.split(d, dim=-1)
        q, k, v = (t.view(n_batch, n, self.h, d // self.h) for t in (q, k, v))
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.h)
        att = att.softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", att, v)
        return self.w_out(out.reshape(n_batch, n, d))


class KVZeroBias(nn.Module):
    """A fused K/V projection beside a Q one (x-transformers' `to_kv`), its bias `cat(zeros, v_bias)`."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.to_out = nn.Linear(dim, dim)
        _moved(self.v_bias, seed=6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q = self.to_q(x)
        bias = torch.cat([torch.zeros(d, dtype=x.dtype, device=x.device), self.v_bias])
        kv = F.linear(x, self.to_kv.weight, bias)
        if self.bug == "kv_renamed":
            v, k = kv.chunk(2, dim=-1)
        else:
            k, v = kv.chunk(2, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        dots = torch.matmul(q, k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        out = torch.matmul(dots.softmax(dim=-1), v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, d))


class ProjList(nn.Module):
    """Whisper's biases (none on the keys' projection) on three Linear layers in a ModuleList, whose names say no
    role; heads by einsum."""

    def __init__(self, d: int = 32, h: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.bug = h, bug
        self.projs = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)])
        self.out = nn.Linear(d, d)
        _moved(self.projs[0].bias, self.projs[2].bias, seed=7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        parts = [p(x).view(b, n, self.h, d // self.h) for p in self.projs]
        if self.bug == "kv_renamed":
            q, v, k = parts
        else:
            q, k, v = parts
        w = (torch.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(d // self.h)).softmax(-1)
        return self.out(torch.einsum("bhnm,bmhd->bnhd", w, v).reshape(b, n, d))


def _relative_index(n_q: int, n_k: int, clip: int) -> torch.Tensor:
    """Shaw et al.'s clipped distances j - i, shifted to index a table of 2 * clip + 1 rows: [n_q, n_k]."""
    distance = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None]
    return torch.clamp(distance, -clip, clip) + clip


class ShawKeysValues(nn.Module):
    """Shaw et al. (2018), relative keys in the scores and relative values in the output, by einsum; causal."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, clip: int = 3, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.dk, self.clip, self.bug = n_heads, d_model // n_heads, clip, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model) for _ in range(4))
        self.rel_k = nn.Parameter(torch.randn(2 * clip + 1, self.dk) * 0.5)
        self.rel_v = nn.Parameter(torch.randn(2 * clip + 1, self.dk) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (w(x).view(b, n, self.h, self.dk).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        index = _relative_index(n, n, self.clip)
        a_k, a_v = self.rel_k[index], self.rel_v[index]  # [n, n, d_k]
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) + torch.einsum("bhqd,qkd->bhqk", q, a_k)
        scores = scores if self.bug == "no_scale" else scores / math.sqrt(self.dk)
        future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=2 if self.bug == "diagonal" else 1)
        attn = scores.masked_fill(future, float("-inf")).softmax(dim=-2 if self.bug == "softmax_dim" else -1)
        out = torch.einsum("bhqk,bhkd->bhqd", attn, v) + torch.einsum("bhqk,qkd->bhqd", attn, a_v)
        return self.wo(out.transpose(1, 2).reshape(b, n, d))


class ShawValuesTimeMajor(nn.Module):
    """Relative values alone, as the popular `RelativePosition` port writes them: the pattern made time-major,
    `[n_q, b * h, n_k] @ table[n_q, n_k, d_k]`, viewed back and added to `attn @ v`; a padding mask (1 = keep)."""

    def __init__(self, hid_dim: int = 32, n_heads: int = 4, max_relative_position: int = 2,
                 bug: str | None = None) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.bug = n_heads, hid_dim // n_heads, bug
        self.max_relative_position = max_relative_position
        self.table_v = nn.Parameter(torch.empty(2 * max_relative_position + 1, self.head_dim))
        nn.init.xavier_uniform_(self.table_v)
        self.fc_q, self.fc_k, self.fc_v, self.fc_o = (nn.Linear(hid_dim, hid_dim) for _ in range(4))
        self.scale = math.sqrt(hid_dim if bug == "scale_hid" else self.head_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        batch_size, len_q, len_k = query.shape[0], query.shape[1], key.shape[1]
        q = self.fc_q(query).view(batch_size, -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
        k = self.fc_k(key).view(batch_size, -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
        v = self.fc_v(value).view(batch_size, -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
        attn = torch.matmul(q, k.permute(0, 1, 3, 2)) / self.scale
        if mask is not None:
            attn = attn.masked_fill(mask == 0, 0.0 if self.bug == "fill_zero" else -1e10)
        attn = torch.softmax(attn, dim=-1)
        weight1 = torch.matmul(attn, v)
        r_v = self.table_v[_relative_index(len_q, len_k, self.max_relative_position)]  # [len_q, len_k, d]
        weight2 = attn.permute(2, 0, 1, 3).contiguous().view(len_q, batch_size * self.n_heads, len_k)
        weight2 = torch.matmul(weight2, r_v)  # [len_q, b * h, d]
        weight2 = weight2.transpose(0, 1).contiguous().view(batch_size, self.n_heads, len_q, self.head_dim)
        x = (weight1 + weight2).permute(0, 2, 1, 3).contiguous().view(batch_size, -1, self.n_heads * self.head_dim)
        return self.fc_o(x)


class PositionOutputBias(nn.Module):
    """A learned bias per query position and head added to each head's output `[h, max_len, d_head]`; a fused
    qkv, causal by a tril buffer."""

    def __init__(self, dim: int = 32, heads: int = 4, max_len: int = 16, bug: str | None = None) -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out_pos = nn.Parameter(torch.randn(heads, max_len, dim // heads) * 0.5)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("tril", torch.tril(torch.ones(max_len, max_len)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-2, -1)
        att = att * (1.0 if self.bug == "no_scale" else 1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-2 if self.bug == "softmax_dim" else -1)
        y = att @ v + self.out_pos[:, :T]
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class KeyPositionValues(nn.Module):
    """The pattern also averages a learned table of absolute key positions, `attn @ pos_v[:n_k]`, beside `attn @ v`
    (a position read out per query, TUPE-like); no mask."""

    def __init__(self, d: int = 32, h: int = 4, max_len: int = 16, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.bug = h, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.pos_v = nn.Parameter(torch.randn(max_len, d // h) * 0.5)
        self.to_out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (f(x).reshape(b, n, self.h, -1).permute(0, 2, 1, 3) for f in (self.to_q, self.to_k, self.to_v))
        scale = (d if self.bug == "scale_d_model" else d // self.h) ** -0.5
        w = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=1 if self.bug == "softmax_dim" else -1)
        out = torch.matmul(w, v) + torch.matmul(w, self.pos_v[:n])
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, d))


class BiasAfterChunk(nn.Module):
    """A fused qkv without a bias, q_bias and v_bias added once its output is chunked (the keys get none)."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)
        _moved(self.q_bias, self.v_bias, seed=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, v = q + self.q_bias, v + self.v_bias
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-2, -1)
        att = att if self.bug == "no_scale" else att / math.sqrt(d // self.heads)
        return self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class HeadBiasAfterView(nn.Module):
    """Projections without a bias, each given a `[n_head, d_head]` one once its heads are split."""

    def __init__(self, d_model: int = 32, n_head: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.n_head, self.d_head, self.bug = n_head, d_model // n_head, bug
        self.w_q, self.w_k, self.w_v = (nn.Linear(d_model, d_model, bias=False) for _ in range(3))
        self.b_q, self.b_k, self.b_v = (nn.Parameter(torch.zeros(n_head, self.d_head)) for _ in range(3))
        self.w_o = nn.Linear(d_model, d_model)
        _moved(self.b_q, self.b_k, self.b_v, seed=9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.w_q(x).view(b, n, self.n_head, self.d_head) + self.b_q
        k = self.w_k(x).view(b, n, self.n_head, self.d_head) + self.b_k
        v = self.w_v(x).view(b, n, self.n_head, self.d_head) + self.b_v
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.d_head)
        weights = scores.softmax(dim=-2 if self.bug == "softmax_dim" else -1)
        return self.w_o(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, -1))
