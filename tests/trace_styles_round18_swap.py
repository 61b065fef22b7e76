"""Keys and values swapped, or the values taken from the keys, in code that does more to its keys than project them
(round 18's swap), for tests/test_trace_round18_swap.py. Each takes `bug=None`: `kv_swapped` (the keys and values
handed to the attention in each other's place, after the code has rotated and normed its keys) or
`values_from_keys` (the values the keys, the value projection or compression left unused), which trace names by
experiment.

- `MinusThetaGqa`: modded-nanogpt's habit: three projections and an output one no name tells (`to_*`, `proj`), a
  weightless RMS norm of q and k (or none: `qk_norm=False`), then RoPE turning each pair by −θ from a cos/sin
  buffer, heads grouped by `F.scaled_dot_product_attention(..., enable_gqa=True)` (no repeat of the key/value heads).
- `GroupedEinsum`: GQA as a grouped einsum, never repeating the key/value heads (q viewed `[b, n_kv_head, n_group,
  n, d]`), a LayerNorm qk-norm with weights, then GPT-J's interleaved RoPE by +θ, an output projection named
  `mix`.
- `SequenceCompressed`: Linformer's projected sequence as `nn.Linear` over the tokens (`E` for the keys, `F` for the
  values, `permute(0, 2, 1)` around them), after the projections, then heads by `unflatten`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def _grown(module, seed):
    """Move every weight off its initial value, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


def _rope_tables(n, d, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d / 2]
    angles = torch.outer(torch.arange(n, dtype=torch.float64), inv)  # [n, d / 2]
    return angles.cos(), angles.sin()


class MinusThetaGqa(nn.Module):
    """q, k, v as `[b, n, heads, d]`; `F.rms_norm` over each head, then the halves turned by −θ
    (`x1·cos + x2·sin`, `x2·cos − x1·sin`), heads moved before the tokens only at the kernel."""

    def __init__(self, dim=32, n_head=4, n_kv_head=2, max_len=16, qk_norm=True, bug=None):
        super().__init__()
        self.bug, self.n_head, self.n_kv_head, self.d = bug, n_head, n_kv_head, dim // n_head
        self.qk_norm = qk_norm
        self.to_q = nn.Linear(dim, n_head * self.d, bias=False)
        self.to_k = nn.Linear(dim, n_kv_head * self.d, bias=False)
        self.to_v = nn.Linear(dim, n_kv_head * self.d, bias=False)
        self.proj = nn.Linear(n_head * self.d, dim, bias=False)
        cos, sin = _rope_tables(max_len, self.d)
        self.register_buffer("cos", cos.float()[None, :, None, :], persistent=False)  # [1, n, 1, d / 2]
        self.register_buffer("sin", sin.float()[None, :, None, :], persistent=False)
        _grown(self, 1)

    def rotate(self, x):
        n, half = x.size(1), x.size(-1) // 2
        cos, sin = self.cos[:, :n].to(x.dtype), self.sin[:, :n].to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)  # [b, n, heads, d]

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.n_head, self.d)  # [b, n, n_head, d]
        k = self.to_k(x).view(b, n, self.n_kv_head, self.d)  # [b, n, n_kv_head, d]
        v = self.to_v(x).view(b, n, self.n_kv_head, self.d)
        if self.qk_norm:
            q, k = F.rms_norm(q, (self.d,)), F.rms_norm(k, (self.d,))
        q, k = self.rotate(q), self.rotate(k)
        if self.bug == "kv_swapped":
            k, v = v, k
        elif self.bug == "values_from_keys":
            v = k
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)  # [b, n_head, n, d]
        return self.proj(y.transpose(1, 2).reshape(b, n, -1))


class GroupedEinsum(nn.Module):
    """Grouped-query attention without a repeat: q `[b, n_kv_head, n_group, n, d]` against k `[b, n_kv_head, n, d]`
    in one einsum, each head's q and k LayerNormed with weights, then GPT-J's rotate_every_two by +θ."""

    def __init__(self, dim=32, n_head=4, n_kv_head=2, bug=None):
        super().__init__()
        self.bug, self.h, self.kv, self.d = bug, n_head, n_kv_head, dim // n_head
        self.wq = nn.Linear(dim, n_head * self.d)
        self.wk = nn.Linear(dim, n_kv_head * self.d)
        self.wv = nn.Linear(dim, n_kv_head * self.d)
        self.q_ln = nn.LayerNorm(self.d)
        self.k_ln = nn.LayerNorm(self.d)
        self.mix = nn.Linear(n_head * self.d, dim)
        _grown(self, 2)

    @staticmethod
    def rotate_every_two(x):
        n, d = x.shape[-2], x.shape[-1]
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.outer(torch.arange(n, dtype=torch.float64), inv).repeat_interleave(2, dim=-1).to(x.dtype)
        x1, x2 = x[..., ::2], x[..., 1::2]
        turned = torch.stack((-x2, x1), dim=-1).flatten(-2)  # (-x2, x1) pair by pair
        return x * angles.cos() + turned * angles.sin()  # [.., n, d]

    def forward(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.h, self.d).transpose(1, 2)  # [b, n_head, n, d]
        k = self.wk(x).view(b, n, self.kv, self.d).transpose(1, 2)  # [b, n_kv_head, n, d]
        v = self.wv(x).view(b, n, self.kv, self.d).transpose(1, 2)
        q, k = self.rotate_every_two(self.q_ln(q)), self.rotate_every_two(self.k_ln(k))
        if self.bug == "kv_swapped":
            k, v = v, k
        elif self.bug == "values_from_keys":
            v = k
        q = q.view(b, self.kv, self.h // self.kv, n, self.d)  # [b, n_kv_head, n_group, n, d]
        scores = torch.einsum("bkgqd,bksd->bkgqs", q, k) * self.d ** -0.5
        allowed = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out = torch.einsum("bkgqs,bksd->bkgqd", weights, v).reshape(b, self.h, n, self.d)  # [b, n_head, n, d]
        return self.mix(out.transpose(1, 2).reshape(b, n, self.h * self.d))


class SequenceCompressed(nn.Module):
    """Keys and values projected, then each compressed along the sequence by a Linear of its own (Linformer's E and
    F, n tokens -> k), the heads split after; scores by matmul, the heads merged with `flatten`."""

    def __init__(self, dim=24, heads=3, seq_len=10, k=4, bug=None):
        super().__init__()
        self.bug, self.heads = bug, heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.E = nn.Linear(seq_len, k)
        self.F = nn.Linear(seq_len, k)
        self.to_out = nn.Linear(dim, dim)
        _grown(self, 3)

    def forward(self, x):
        q, keys, values = self.to_q(x), self.to_k(x), self.to_v(x)  # [b, n, dim]
        keys = self.E(keys.permute(0, 2, 1)).permute(0, 2, 1)  # [b, k, dim]
        if self.bug == "values_from_keys":
            values = keys
        else:
            values = self.F(values.permute(0, 2, 1)).permute(0, 2, 1)
        if self.bug == "kv_swapped":
            keys, values = values, keys
        q, keys, values = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, keys, values))
        scores = q @ keys.transpose(-2, -1) / q.size(-1) ** 0.5  # [b, heads, n, k]
        out = scores.softmax(dim=-1) @ values  # [b, heads, n, d]
        return self.to_out(out.transpose(1, 2).flatten(2))
